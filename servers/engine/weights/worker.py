"""The part of weight transfer that runs inside vLLM's worker processes.

vLLM mixes ``WeightTransferWorker`` into its Worker (engine argument ``worker_extension_cls``);
the server calls its ``skyrl_*`` methods through ``collective_rpc`` with the names and payloads
of ``protocol``, serialized without pickle: only plain values and bytes cross (tensors are
rebuilt from bytes here).

Received parameters are staged on the host; nothing touches the serving model before
``skyrl_commit``. The worker keeps the serving weights in checkpoint format
(``checkpoint.ServingCheckpoint``, first read from the model's safetensors files): whole new
tensors are staged beside it, patches are written into it in place with a record of what they
overwrote. A commit reloads it as a complete checkpoint, because vLLM fuses parameters (q/k/v,
gate/up) and a partial reload would reinitialise the fused halves it was not given;
``reload_weights`` re-runs vLLM's post-load processing, which plain ``load_weights`` after
start-up does not. If the reload fails, the previous weights are loaded back. Checksums are
computed from the serving values.

After a commit what it replaced is kept (whole tensors: the previous ones; patches: the
overwritten elements) until the next update starts, so ``skyrl_rollback`` can serve the
previous weights again when another server of the fleet failed to commit.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta
from typing import Any

from .checkpoint import ServingCheckpoint, bits_of
from .finite import all_finite
from .protocol import (
    PATCH_INDEX_BYTES,
    Bucket,
    Checksum,
    Group,
    ParameterShape,
    Received,
    StagedParameter,
)

log = logging.getLogger(__name__)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _sha256_of(tensor: Any) -> bytes:
    """SHA-256 of a tensor's raw bytes (the checksums a trainer compares with its own)."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch_uint8()).numpy()).digest()


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def receive_buckets(
    group: Any, buckets: list[Bucket], timeout_seconds: float, check_finite: bool = False
) -> tuple[dict[str, Any], int, list[str], list[str]]:
    """Receives ``buckets`` from rank 0 of ``group``.

    Returns the parameters as host tensors (views of their bucket: each bucket has a buffer of
    its own, so no copy), the bytes received and the names whose SHA-256 did not match. The
    receive of the next bucket is posted before the current one is sliced and verified, so
    checksumming overlaps the transfer.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = timedelta(seconds=timeout_seconds)

    def post(bucket: Bucket) -> tuple[Any, Any]:
        buffer = torch.empty(int(bucket["size"]), dtype=torch.uint8, device=device)
        return buffer, group.broadcast(buffer, 0)

    received: dict[str, Any] = {}
    mismatches: list[str] = []
    non_finite: list[str] = []
    total = 0
    pending = post(buckets[0]) if buckets else None
    for index, bucket in enumerate(buckets):
        assert pending is not None
        buffer, work = pending
        work.wait(timeout)
        pending = post(buckets[index + 1]) if index + 1 < len(buckets) else None
        host = buffer.cpu()
        total += host.numel()
        for param in bucket["params"]:
            start = int(param["offset"])
            dtype = getattr(torch, param["dtype"])
            count = 1
            for dim in param["shape"]:
                count *= int(dim)
            raw = host[start : start + count * dtype.itemsize]
            if param.get("sha256") and hashlib.sha256(raw.numpy()).digest() != param["sha256"]:
                mismatches.append(param["name"])
                continue
            if check_finite and not all_finite(raw.numpy(), param["dtype"]):
                non_finite.append(param["name"])
                continue
            received[param["name"]] = raw.view(dtype).reshape(param["shape"])
    return received, total, mismatches, non_finite


class WeightTransferWorker:
    """Mixin for vLLM's Worker. All state lives in ``_skyrl_*`` attributes."""

    # vLLM's Worker, which this class is mixed into, provides the model runner.
    model_runner: Any
    _skyrl_group: Any = None
    _skyrl_checkpoint: ServingCheckpoint | None = None
    _skyrl_timeout: float = 300.0

    def _skyrl_serving(self) -> ServingCheckpoint:
        """The serving weights in checkpoint format, read from the model's files on first use."""
        if self._skyrl_checkpoint is None:
            self._skyrl_checkpoint = ServingCheckpoint(self._skyrl_read_checkpoint)
        return self._skyrl_checkpoint

    def _skyrl_read_checkpoint(self) -> dict[str, Any]:
        from pathlib import Path

        from safetensors.torch import load_file

        model_dir = Path(self.model_runner.model_config.model)
        weights: dict[str, Any] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(path), device="cpu"))
        if not weights:
            raise RuntimeError(f"no safetensors weights in {model_dir} to update")
        return weights

    def skyrl_layout(self) -> dict[str, ParameterShape]:
        """Element type and shape of every checkpoint parameter."""
        return {
            name: ParameterShape(dtype=_dtype_name(t), shape=list(t.shape))
            for name, t in self._skyrl_serving().tensors.items()
        }

    def skyrl_checksums(self, names: list[str]) -> list[Checksum]:
        """SHA-256 of the serving weights (all when ``names`` is empty), sorted by name."""
        serving = self._skyrl_serving()
        result = []
        for name in names or sorted(serving.tensors):
            tensor = serving.serving_value(name)
            result.append(
                Checksum(
                    name=name,
                    sha256=_sha256_of(tensor),
                    dtype=_dtype_name(tensor),
                    shape=list(tensor.shape),
                )
            )
        return result

    def skyrl_join_group(self, group: Group) -> int:
        """Joins the trainer's group as ``rank_offset + this worker's rank``; returns the rank."""
        from skyrl_grpc.process_group import join_group

        rank = group["rank_offset"] + int(getattr(self, "rank", 0))
        self._skyrl_group = join_group(
            group["backend"],
            group["master_address"],
            group["master_port"],
            rank,
            group["world_size"],
            group["group_name"],
            group["timeout_seconds"],
        )
        self._skyrl_timeout = group["timeout_seconds"]
        return rank

    def skyrl_leave_group(self) -> None:
        """Drops the group (its connections close with it)."""
        self._skyrl_group = None

    def skyrl_receive_buckets(self, buckets: list[Bucket], check_finite: bool) -> Received:
        """Receives each bucket (validated by the server) by broadcast from rank 0 and stages
        its parameters.

        Every bucket is received even after a checksum mismatch or a non-finite value, so the
        trainer's broadcasts never hang; those are returned and nothing of this call is staged
        then.
        """
        if self._skyrl_group is None:
            raise RuntimeError("not in a weight-transfer group: call InitWeightTransfer first")
        received, total, mismatches, non_finite = receive_buckets(
            self._skyrl_group, buckets, self._skyrl_timeout, check_finite
        )
        if not mismatches and not non_finite:
            serving = self._skyrl_serving()
            for name, tensor in received.items():
                serving.stage_whole(name, tensor)
        return Received(
            bytes=total, params=len(received), mismatches=mismatches, non_finite=non_finite
        )

    def skyrl_stage(self, params: list[StagedParameter]) -> list[str]:
        """Stages in-band parameters (already verified by the server). A patch is applied to
        the serving copy in place (bit for bit, as integers; what it overwrote is recorded) and
        checked against its SHA-256 when it carries one; returns the names that did not match,
        and stages nothing of the call then."""
        import torch

        serving = self._skyrl_serving()
        mark = serving.mark()
        mismatches: list[str] = []
        for param in params:
            dtype = getattr(torch, param["dtype"])
            if param.get("patch"):
                tensor = self._skyrl_patch(serving, param, dtype)
                expected = param.get("sha256", b"")
                if expected and _sha256_of(tensor) != expected:
                    mismatches.append(param["name"])
                continue
            # One copy, into memory torch may keep writable.
            buffer = bytearray().join(param["chunks"])
            tensor = torch.frombuffer(buffer, dtype=dtype).reshape(param["shape"])
            serving.stage_whole(param["name"], tensor)
        if mismatches:
            serving.revert_to(mark)
        return mismatches

    @staticmethod
    def _skyrl_patch(serving: ServingCheckpoint, param: StagedParameter, dtype: Any) -> Any:
        """Applies ``param``'s patch; returns the patched tensor."""
        import numpy as np
        import torch

        changed = int(param["patch"])
        payload = b"".join(param["chunks"])
        indices = torch.from_numpy(
            np.frombuffer(payload, dtype="<u4", count=changed).astype(np.int64)
        )
        values = torch.frombuffer(
            bytearray(payload[changed * PATCH_INDEX_BYTES :]), dtype=bits_of(dtype.itemsize)
        )
        return serving.patch(param["name"], indices, values)

    def skyrl_discard(self) -> int:
        return self._skyrl_serving().discard()

    def skyrl_commit(self) -> int:
        """Loads the open update (completed by the serving copy) into the serving model."""
        serving = self._skyrl_serving()
        if not serving.staged_count:
            return 0
        try:
            self.model_runner.reload_weights(weights_iterator=iter(serving.pending().items()))
        except Exception:
            log.exception("reloading the new weights failed; restoring the previous ones")
            serving.discard()
            self.model_runner.reload_weights(weights_iterator=iter(serving.tensors.items()))
            raise
        return serving.commit()

    def skyrl_rollback(self) -> int:
        """Serves the weights from before the last commit again."""
        serving = self._skyrl_serving()
        restored = serving.revert_commit()
        self.model_runner.reload_weights(weights_iterator=iter(serving.tensors.items()))
        return restored

    def skyrl_release_rollback(self) -> None:
        self._skyrl_serving().release_commit()

    def skyrl_clear_kv_cache(self) -> int:
        """Zeroes every KV cache tensor; returns the bytes cleared. Only while no request holds
        KV: non-finite values left in a block by non-finite weights reach the next requests
        that get that block (attention reads whole blocks, and 0 x NaN is NaN)."""
        cleared = 0
        for tensor in self.model_runner.kv_caches:
            tensor.zero_()
            cleared += tensor.numel() * tensor.element_size()
        return cleared
