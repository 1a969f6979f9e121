"""This project's weight-transfer engine for vLLM (``vllm.distributed.weight_transfer``).

vLLM creates one ``WeightTransferEngine`` per worker when the engine starts with
``weight_transfer_config={"backend": "skyrl"}`` (registered through vLLM's factory by
``vllm_plugin``), and drives it through its own lifecycle: ``AsyncLLM.init_weight_transfer_engine``
(join the trainer's process group), ``start_weight_update``, any number of ``update_weights``,
``finish_weight_update(weight_version)``. vLLM has no engine for what this one carries: weights
pushed in-band over gRPC (the server hands the verified chunks on as ``update_weights`` payloads),
gloo broadcasts for CPU fleets, and sparse patches against a checkpoint-format copy.

Why a copy: on CPU vLLM repacks linear weights after loading (oneDNN), so neither a patch in
checkpoint coordinates nor ``load_weights`` can be written into the serving parameters; new
weights reach them through vLLM's layerwise reload of checkpoint tensors. The engine keeps the
serving weights as the checkpoint holds them (``checkpoint.ServingCheckpoint``, read from the
model's safetensors files on first use): whole tensors are staged beside it, patches written into
it in place with a record of what they overwrote. Nothing the serving model uses changes before
``finish_weight_update``: a decoder layer is reloaded, set aside, once all its tensors arrived
(``prepared_layers``; vLLM fuses q/k/v and gate/up, so a layer is reloaded whole), and the finish
swaps those in and reloads what was not prepared. A fleet transaction needs that separation.

What a transaction needs beyond vLLM's lifecycle rides in the update payload (``SkyrlUpdate``):
``discard`` ends the open update without applying it, ``restore_previous`` serves the weights
from before the last commit again (a fleet rollback). Expected failures (a checksum mismatch, a
non-finite value, a reload that failed and was undone) are recorded in ``report`` instead of
raised, because vLLM's worker ends the update session on an exception and a failed finish leaves
it open; the server reads the report through the worker extension (``worker``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    layerwise_groups,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing

from servers.engine.transfer.handoff import HandoffReader
from servers.engine.transfer.protocol import (
    COMMIT_PREPARE_ENVIRONMENT,
    HEAP_SLACK_ENVIRONMENT,
    Bucket,
    Group,
    Report,
    StagedParameter,
    empty_report,
)
from servers.engine.worker import patch_kernels
from servers.engine.worker.checkpoint import ServingCheckpoint, read_checkpoint
from servers.engine.worker.heap import HeapKeeper, give_heap_back, touch_heap
from servers.engine.worker.prepared_layers import PreparedLayers, set_aside, swap_is_sound
from servers.engine.worker.reload_logs import quiet_reload_logs
from servers.engine.worker.tp_share import Plan, Row, StreamAborted, TensorParallelShare
from servers.engine.worker.worker_receive import apply_patch, receive_buckets, stage
from skyrl_grpc.dtypes import num_elements, torch_name
from skyrl_grpc.host_memory import freed_memory_trim
from skyrl_grpc.tensor_bytes import sha256_of

# A worker gives freed heap back once it has grown past its start by this many times the
# weight bytes it holds (its shard of the model, and the checkpoint copy at rank 0): 2x the
# model at TP=1, where a full update legitimately keeps one more copy (the rollback). The
# server's --weight-heap-slack sets it (HEAP_SLACK_ENVIRONMENT); negative: never.
HEAP_SLACK = 1.0

log = logging.getLogger(__name__)


@dataclass
class SkyrlGroup(WeightTransferInitInfo):
    """How the workers join the trainer's process group."""

    group: Group


@dataclass
class SkyrlUpdate(WeightTransferUpdateInfo):
    """One ``update_weights`` payload: exactly one of its parts is set."""

    # In-band parameters verified by the server (whole tensors or patches).
    stage: list[StagedParameter] = field(default_factory=list)
    # The server's shared-memory buffer the staged bytes lie in (``handoff``; "": inline).
    handoff: str = ""
    # Broadcasts to receive from rank 0 of the group, and whether to refuse non-finite values.
    receive: list[Bucket] = field(default_factory=list)
    check_finite: bool = False
    # End the open update without applying it.
    discard: bool = False
    # Serve the weights from before the last commit again (applied by finish).
    restore_previous: bool = False


class SkyrlWeightTransferEngine(WeightTransferEngine[SkyrlGroup, SkyrlUpdate]):
    init_info_cls = SkyrlGroup
    update_info_cls = SkyrlUpdate
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.timeout_seconds = 300.0
        self._checkpoint: ServingCheckpoint | None = None
        self._restoring = False
        self.report: Report = empty_report()
        # Only TP rank 0 keeps the checkpoint-format copy; the others read it (``tp_share``).
        self.share = TensorParallelShare()
        self._handoff = HandoffReader()
        self._heap: HeapKeeper | None = None
        # Layers of the open update reloaded as their tensors arrived, swapped in at the commit.
        sound = swap_is_sound(self.device, self.model_config.enforce_eager)
        self.prepared = PreparedLayers(sound and os.environ.get(COMMIT_PREPARE_ENVIRONMENT) == "1")
        self._groups: list[list[str]] = []
        # Heap the reload at start gave back, touched again with the staging memory.
        self._given_back = 0
        if self.holds_copy:
            # Read now, while the engine starts, not at the first update: that update's time
            # and the server's memory then never hold a surprise (an RL server is updated
            # every step). A model without safetensors files still serves; updating it fails.
            try:
                self.serving.tensors  # noqa: B018 - read for its effect
            except Exception:
                log.warning("no checkpoint copy to update: weight updates will fail", exc_info=True)
                self._checkpoint = None

    @property
    def holds_copy(self) -> bool:
        return self.share.holds_copy

    # -- the serving weights in checkpoint format ------------------------------------------

    @property
    def serving(self) -> ServingCheckpoint:
        if not self.holds_copy:
            raise RuntimeError("only tensor-parallel rank 0 keeps the serving checkpoint")
        if self._checkpoint is None:
            tensors, shared = read_checkpoint(self._checkpoint_files(), self.model_config.model)
            self._checkpoint = ServingCheckpoint(lambda: tensors, shared)
        return self._checkpoint

    def _checkpoint_files(self) -> list[Any]:
        """The model's safetensors files (``pathlib.Path``), in order."""
        from pathlib import Path

        return sorted(Path(self.model_config.model).glob("*.safetensors"))

    # -- vLLM's lifecycle ------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> SkyrlGroup:
        expected = set(Group.__required_keys__)
        if set(init_dict) != expected:
            raise ValueError(f"init_info needs exactly {sorted(expected)}, got {sorted(init_dict)}")
        return SkyrlGroup(Group(**init_dict))  # type: ignore[typeddict-item]

    def init_transfer_engine(self, init_info: SkyrlGroup) -> None:
        """Joins the trainer's group as ``rank_offset`` + this worker's tensor-parallel group:
        only the worker keeping the checkpoint copy joins (the others read that copy, so the
        trainer's broadcasts reach one worker per server, not every rank)."""
        from skyrl_grpc.process_group import join_group

        group = init_info.group
        self.timeout_seconds = group["timeout_seconds"]
        if not self.holds_copy:
            return
        tp_group = int(self.parallel_config.rank) // self.share.size
        self.group = join_group(
            group["backend"],
            group["master_address"],
            group["master_port"],
            group["rank_offset"] + tp_group,
            group["world_size"],
            group["group_name"],
            group["timeout_seconds"],
        )

    def shutdown(self) -> None:
        self.group = None  # its connections close with it

    def start_weight_update(self) -> None:
        """Opens an update: staging left by an update that never finished is dropped."""
        self.report = empty_report()
        self._restoring = False
        self.prepared.clear()
        if self._checkpoint is not None:
            self._checkpoint.discard()
        if self._heap is None:  # where the worker stands before its first update
            model = sum(path.stat().st_size for path in self._checkpoint_files())
            tp = self.vllm_config.parallel_config.tensor_parallel_size
            held = model // tp + (model if self.holds_copy else 0)  # its shard, and the copy
            slack = float(os.environ.get(HEAP_SLACK_ENVIRONMENT, HEAP_SLACK))
            trim = freed_memory_trim() if slack >= 0 else None
            self._heap = HeapKeeper(int(slack * held), trim)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator; here everything received is on the host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SkyrlUpdate) -> None:
        self.report = empty_report()
        if update_info.discard:
            self.prepared.clear()
            if self.holds_copy:
                self.report["changed"] = self.serving.discard()
        elif update_info.restore_previous:
            self._restoring = True
        elif update_info.receive or update_info.stage:
            if update_info.receive:
                self._receive(update_info.receive, update_info.check_finite)
            elif self.holds_copy:
                self._stage(update_info.stage, update_info.handoff)
            self._prepare_arrived()

    def finish_weight_update(self) -> None:
        """Applies the open update (or the restore) to the serving model, on every rank in
        step (the holder decides what is reloaded); then gives freed heap back if it piled up."""
        try:
            self._finish()
        finally:
            if self._heap is not None:
                self._heap.check()

    def free_rollback(self) -> int:
        """Frees what a rollback would restore (and spare buffers) and gives their memory back
        to the system at once: after a fleet commit a server holds one copy of the model.
        Returns the bytes of weights freed. In shared memory that is immediate; a copy in the
        heap needs the freed heap trimmed, which also gives back what vLLM's reloads freed (the
        next reload then faults it in again), so only then."""
        if not self.holds_copy or self._checkpoint is None:
            return 0  # the other ranks keep no copy
        freed = self._checkpoint.free_commit()
        if self._checkpoint.shared is None:
            give_heap_back()
        return freed

    def _finish(self) -> None:
        holder = self.holds_copy
        self.report = empty_report()
        if self._restoring:
            self._restoring = False
            self.prepared.clear()
            names = self.serving.committed_names() if holder else set()
            if holder:
                self.report["changed"] = self.serving.revert_commit()
            self._reload(names)
            return
        names = self.serving.open_names() if holder else set()
        error = ""
        reloaded: set[str] = set()
        try:
            reloaded = self._reload(self.prepared.to_reload(names), pending=True)
        except StreamAborted as exc:
            error = str(exc)
        except Exception as exc:
            log.exception("reloading the new weights failed; restoring the previous ones")
            error = f"{type(exc).__name__}: {exc}"
        # Every rank restores if any failed: they reload in lockstep.
        if not self.share.outcome(not error):
            self.prepared.clear()
            if holder:
                self.serving.discard()
            self._reload(names)
            self.report["error"] = error or "another tensor-parallel rank failed to reload"
            return
        self.prepared.swap_in(reloaded.__contains__)
        if holder:
            self.report["changed"] = self.serving.commit()

    def warm_reload(self, trim: bool = False) -> int:
        """Reloads every decoder layer from the serving weights, which stay bit for bit what
        they are: called once at start, so what vLLM's first reload pays once (on CPU, fresh
        memory for every repacked linear weight: a 0.3B float32 model's first commit took
        1.35 s against ~0.6 s later) is paid before a trainer waits. Returns the parameters
        reloaded (0 on ranks that keep no copy, and where there is no copy to reload)."""
        if self.holds_copy and self._checkpoint is None:
            # No checkpoint copy (a warning said so at start): the other ranks learn there is
            # nothing to reload.
            self.share.agree([])
            return 0
        names = set(self.serving.tensors) if self.holds_copy else set()
        self._reload(names)  # before the first update: its heap keeper counts from here
        if self.holds_copy:  # the patch loops compiled for these weights: not in an update
            patch_kernels.prepare({t.element_size() for t in self.serving.tensors.values()})
        if trim:  # what the reload freed (the weights it replaced)
            self._given_back = give_heap_back()
        return len(names)

    def prepare_spares(self) -> int:
        """The staging memory a full update writes into, allocated and touched now (the
        server's ``--weight-staging`` says when); its bytes."""
        if not self.holds_copy or self._checkpoint is None:
            return 0
        # With the heap the reload at start gave back: the first commit's reload needs it.
        allocated = self.serving.prepare_spares() + touch_heap(self._given_back)
        self._given_back = 0
        return allocated

    # -- receiving --------------------------------------------------------------------------

    def _stage(self, params: list[StagedParameter], handoff: str) -> None:
        """Stages in-band parameters (verified by the server): ``worker_receive.stage``."""
        if handoff:
            self.report["handoff_error"] = self._handoff.why_unreadable(handoff)
            if self.report["handoff_error"]:
                return
        staged = stage(self.serving, params, lambda region: self._handoff.view(handoff, region))
        self.report["params"] = len(staged["completed"])
        self.report["mismatches"] = staged["mismatches"]
        self.report["non_finite"] = staged["non_finite"]
        if not staged["mismatches"]:
            self.prepared.arrived(staged["completed"])

    def _receive(self, buckets: list[Bucket], check_finite: bool) -> None:
        """Receives each bucket by broadcast from rank 0 and stages its parameters: whole ones
        beside the serving copy, patches into it (checked against their SHA-256 once applied).

        Every bucket is received even after a checksum mismatch or a patch that does not fit,
        so the trainer's broadcasts never hang; nothing of this call is staged then. Non-finite
        values are staged and named in the report: the server rejects them (and discards the
        update) unless it was started to accept them."""
        if not self.holds_copy:
            return  # not in the group: the broadcasts reach the copy's holder only
        if self.group is None:
            raise RuntimeError("not in a weight-transfer group: call InitWeightTransfer first")
        received = receive_buckets(
            self.group,
            buckets,
            self.timeout_seconds,
            check_finite,
            buffer=None if torch.cuda.is_available() else self._host_buffer,
        )
        rejected = received.mismatches or received.invalid
        if not rejected:
            serving = self.serving
            mark = serving.mark()
            for name, tensor in received.whole.items():
                serving.stage_whole(name, tensor)
            for param, raw in received.patches:
                patched, finite = apply_patch(serving, param, raw)
                if check_finite and not finite:
                    received.non_finite.append(param["name"])
                if param["sha256"] and sha256_of(patched) != param["sha256"]:
                    received.mismatches.append(param["name"])
            if received.mismatches:
                serving.revert_to(mark)
            else:
                self.prepared.arrived(p["name"] for bucket in buckets for p in bucket["params"])
        self.report["bytes"] = received.bytes
        self.report["params"] = sum(len(bucket["params"]) for bucket in buckets)
        self.report["mismatches"] = received.mismatches
        self.report["non_finite"] = received.non_finite
        self.report["invalid"] = received.invalid

    def _host_buffer(self, index: int, bucket: Bucket) -> torch.Tensor:
        """Where bucket ``index`` of a broadcast is received on the host: a one-parameter
        bucket straight into a recycled tensor of that parameter (``buffer_for``: in the shared
        copy, where the other ranks read it), any other into a new one."""
        size = int(bucket["size"])
        params = bucket["params"]
        if len(params) == 1 and not params[0]["patch"] and params[0]["offset"] == 0:
            param = params[0]
            dtype = getattr(torch, param["dtype"])
            if num_elements(param["shape"]) * dtype.itemsize == size:
                tensor: torch.Tensor = self.serving.buffer_for(param["name"], param["shape"], dtype)
                return tensor.view(-1).view(torch.uint8)
        return torch.empty(size, dtype=torch.uint8)

    # -- applying ---------------------------------------------------------------------------

    def _prepare_arrived(self) -> None:
        """Reloads, set aside for the commit (``prepared_layers``), the decoder layers every
        tensor of which has arrived in the open update; a failure leaves them to the commit."""
        if not self.prepared.enabled:  # alike on every rank
            return
        ready: list[str] = []
        if self.holds_copy and self._checkpoint is not None:
            if not self._groups:
                self._groups = layerwise_groups(list(self.serving.tensors))
            ready = self.prepared.ready(self._groups)
        if self.share.size == 1 and not ready:
            return
        error = ""
        planned: set[str] = set()
        with set_aside(self.model) as unit:
            try:
                planned = self._reload(set(ready), pending=True)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Every rank keeps the unit or none does: the holder's commit plan counts on it.
        if self.share.outcome(not error):
            unit.names = frozenset(planned)
            self.prepared.add(unit)
        else:
            log.warning("preparing layers ahead of the commit failed (%s): it reloads them", error)

    def _reload(self, names: set[str], pending: bool = False) -> set[str]:
        """Reloads the decoder layers holding ``names`` through vLLM's layerwise reload: whole
        layers (fused parameters need all their parts), from the open update when ``pending``,
        else from the serving copy. Returns the names reloaded (alike on every rank)."""
        weights: dict[str, Any] | None = None
        plan: Plan | None = None
        path = ""  # where the other ranks read the copy (``shared_copy``)
        if self.holds_copy:
            weights = self.serving.pending() if pending else self.serving.tensors
            layers = [g for g in layerwise_groups(list(weights)) if names.intersection(g)]
            plan = [
                Row(
                    name,
                    torch_name(weights[name].dtype),
                    list(weights[name].shape),
                    self.serving.location(weights[name]),
                )
                for group in layers
                for name in group
            ]
            path = self.serving.shared.path if self.serving.shared is not None else ""
        plan = self.share.agree(plan, path)
        if not plan:
            return set()
        # vLLM warns for every layer a reload leaves as it was: expected here, not a failure.
        with quiet_reload_logs():
            try:
                reload_weights(
                    self.vllm_config,
                    self.model,
                    weights_iterator=self.share.stream(plan, weights),
                    weights_path=None,
                    is_checkpoint_format=True,
                )
            except BaseException:
                self._end_broken_reload()
                raise
        return {row.name for row in plan}

    def _end_broken_reload(self) -> None:
        """Ends the layerwise reload a failure broke off: without it the layers not reached stay
        on the meta device with vLLM's wrapped loaders, and the reload of the previous weights
        that follows fails ("'Parameter' object has no attribute 'weight_loader'"). vLLM's
        finalize puts the untouched layers' kernel tensors back and processes the ones half
        loaded; the reload that follows rewrites every layer the update touched."""
        try:
            finalize_layerwise_processing(self.model, self.model_config)
        except Exception:
            log.exception("ending the broken reload failed too")
