"""Weights on every server of the fleet: the collective group, updates as fleet-wide
transactions (``weight_transaction``), cancel, rollback, checksums and versions.

How bytes move is ``trainer_client.weights.weight_sending`` (buckets over the collective group,
or chunks over gRPC streams); this module makes the calls around them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

from skyrl_grpc import tracing
from skyrl_grpc.process_group import free_port
from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.client_core import ClientCore
from trainer_client.config import DEFAULT, Timeout
from trainer_client.cut_out import CLEANUP_SECONDS, commit_cutting_out, cutting_out
from trainer_client.exceptions import FailedPrecondition
from trainer_client.fanout import fan_out
from trainer_client.fleet_info import (
    ServerInfo,
    UpdatePhases,
    WeightCommit,
    WeightUpdateResult,
    refuse_unless_all,
)
from trainer_client.readiness import wait_while_starting
from trainer_client.results import WeightVersions
from trainer_client.weights.relay_plan import relay_for
from trainer_client.weights.update_plan import (
    PushedWeights,
    Sending,
    ServerState,
    UpdatePlan,
    make_plan,
    reserve_record,
)
from trainer_client.weights.weight_calls import ServerWeightCalls
from trainer_client.weights.weight_delivery import LocalWeights, WeightDelivery
from trainer_client.weights.weight_sending import (
    DEFAULT_BUCKET_BYTES,
    CollectiveSender,
    cuda_bytes,
    rank_offsets,
)
from trainer_client.weights.weight_transaction import run_weight_transaction

log = logging.getLogger(__name__)
T = TypeVar("T")
WeightTransport = Literal["collective", "grpc"]


class WeightUpdates:
    """Weight calls (``InferenceClient.weights``), over ``core``'s channels. Holds the weight
    path's process-local state (``local``): a client pickles its config alone, so a client
    handed to another process starts without it."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core
        self.config = core.config
        self.local = LocalWeights()
        # How an update's bytes reach the servers.
        self.delivery = WeightDelivery(core, self.local)

    @property
    def last_push_bytes(self) -> dict[str, int]:
        """Bytes of parameter data each server received in the last update."""
        return self.local.last_push_bytes

    @property
    def last_sent_bytes(self) -> int:
        """Bytes this client itself sent in the last in-band update (relayed: each stream
        once, whatever the fleet's size)."""
        return self.local.last_sent_bytes

    @property
    def has_weight_group(self) -> bool:
        """True once ``init_weight_transfer`` formed the collective group."""
        return self.local.sender is not None

    async def init_weight_transfer(
        self,
        backend: str = "gloo",
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "skyrl",
        timeout_seconds: float = 300.0,
    ) -> dict[str, int]:
        """Forms the collective group: this process is rank 0, each server joins with its own
        rank offset (computed from the ranks each server takes: ``group_ranks``). Returns each
        server's offset."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl' (in-band needs no group)")
        request = cp.GetServerInfoRequest()
        servers = await self._core.control_servers()
        infos = await self._core.fan_out(
            lambda s: s.GetServerInfo, request, DEFAULT, ServerInfo.from_proto
        )
        # Before the group forms: a server that cannot join would leave the others waiting.
        operation = f"init_weight_transfer({backend!r})"
        refuse_unless_all(operation, infos, lambda i: i.capabilities.cannot_join(backend))
        offsets, world_size = rank_offsets([infos[a].weight_group_ranks for a in servers])
        port = master_port or free_port(master_address)
        sender = CollectiveSender(
            backend, master_address, port, world_size, group_name, timeout_seconds
        )
        by_server = dict(zip(servers, offsets, strict=True))
        self.local.group_servers = list(servers)
        nccl = backend == "nccl"
        proto_backend = cp.WEIGHT_TRANSFER_BACKEND_NCCL if nccl else cp.WEIGHT_TRANSFER_BACKEND_GLOO

        async def init_or_give_up(address: str) -> cp.InitWeightTransferResponse:
            request = cp.InitWeightTransferRequest(
                backend=proto_backend,
                master_address=master_address,
                master_port=port,
                rank_offset=by_server[address],
                world_size=world_size,
                group_name=group_name,
                timeout_seconds=int(timeout_seconds),
            )
            try:
                return await self._core.unary(
                    address,
                    self._core.control(address).InitWeightTransfer,
                    request,
                    timeout_seconds,
                    plane="control",
                )
            except BaseException:
                sender.cancel_join()  # the others stop waiting for this server at once
                raise

        # Both sides block until every rank joined: run the trainer's join beside the servers'.
        join = asyncio.ensure_future(asyncio.to_thread(sender.join))
        try:
            await fan_out("InitWeightTransfer", servers, init_or_give_up)
        except BaseException:
            sender.cancel_join()
            # The join thread ends promptly; its error (the rendezvous given up) says nothing
            # the fan-out's does not. Every server's call has ended, so none still reads the
            # store: close it, freeing the master port.
            await asyncio.gather(join, return_exceptions=True)
            sender.release()
            raise
        await join
        self.local.sender = sender
        return by_server

    @tracing.traced("update_weights")
    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        weight_version: int | None = None,
        *,
        transport: WeightTransport | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int | None = None,
        checksums: bool = False,
        timeout: float = 600.0,
        lease_seconds: int = 0,
        delta: bool = True,
        compress_patches: bool = False,
        wait_for_starting: float = 120.0,
        release_memory: bool = False,
        cut_out_unreachable: bool | None = None,
    ) -> WeightUpdateResult:
        """Pushes new weights to every server and commits ``weight_version`` on all of them,
        or on none: a fleet-wide transaction (``trainer_client.weights.weight_transaction``).

        ``weight_version``: what the new weights serve as; must be newer than what every server
        serves, and is checked before any weight is sent. None: one more than the newest
        version any server serves. ``transport``: "collective" (the group from
        ``init_weight_transfer``) or "grpc" (in-band streams, no group needed); None: the
        group if one was formed, else "grpc". ``checksums``: also send every parameter's
        SHA-256, which each server checks on what it assembled (after applying a patch): an
        end-to-end proof that costs about a second per GB on each side. Without it in-band
        chunks are still CRC-32-checked and patches apply only to the version they name;
        ``weight_checksums()`` gives the same proof on demand. ``timeout``: seconds for the
        transfer. ``chunk_bytes``: bytes of parameter data per in-band chunk; None: 4 MiB to a
        server streamed to directly, less down a relay tree (1/128 of the tree's share, 256
        KiB to 4 MiB: every hop forwards a chunk once it has it whole, so smaller chunks fill
        and drain the relay's pipeline sooner).
        ``lease_seconds``: how long the servers keep the update open if this process dies
        mid-way (0: their default). ``delta``: send only what changed since the version
        this client pushed last (``delta_patches.weight_patches``), to each server serving
        it; a server on another version gets the whole weights in the same transaction
        (in-band: that server alone; over the collective, whose broadcasts reach every
        server: all of them). The client then keeps a copy of the weights it pushed (on their
        device: one model's bytes of GPU or host memory), the base of the next delta;
        ``delta=False`` keeps none. ``compress_patches``: patches travel zstd-compressed
        (indices as gaps, values as XORs with the base: an RL step's patch shrinks 3-5x), for
        links slower than the CPUs: compressing costs the trainer CPU time once, decompressing
        each server less (``patch_format``; measured in docs/weights.md). A server
        that does not take them (older than this client) gets its patches uncompressed (over
        the collective, whose broadcasts reach every server: all of them).
        ``wait_for_starting``: seconds to wait first for servers that are up but not serving
        yet (restarted or added, warming up or catching up with their peers), so the update
        includes them instead of failing on them (0: do not wait).
        ``release_memory``: once every server committed, each frees the weights this update
        replaced and gives the freed memory back to the system (``ReleaseRollback``), so an
        idle server holds one copy of the model, for a host shared with a trainer between
        steps. The price: ``rollback_weights`` can no longer undo this update, and the next
        update touches fresh memory instead of reusing it (2x its time on the benchmark VM,
        docs/weights.md). By default servers keep them until the next update starts, which
        reuses their memory.
        ``cut_out_unreachable`` (in-band only; None: ``ClientConfig.cut_out_unreachable``): a
        server that cannot be reached, not even to ask its version, once the update failed on
        it (at ``timeout``, for a partition) is cut out: the update runs again at once on the
        others, and the result's ``cut_out`` names it. It keeps its previous weights, which
        placement keeps calls off, until a later call takes it back (``trainer_client.cut_out``).

        On any failure (a server unreachable, a rejected chunk or version, a timeout) the update
        is cancelled on every server and rolled back where it was already committed, then
        ``WeightUpdateError`` names each server, what happened there and the version it serves
        now. Returns each server's answer to the commit, and where the update waited (``phases``).
        """
        tensors = list(named_tensors)
        if weight_version is not None and weight_version <= 0:
            # 0 means "unset" on the wire and every server starts at 0: refused before a byte
            # moves, instead of after the whole model was pushed.
            raise ValueError(
                f"weight_version={weight_version}: versions start at 1 and must increase "
                "(None: one more than the newest version any server serves)"
            )
        first_calls = ServerWeightCalls(self._core, lease_seconds)
        sender, servers = await self._route(transport, first_calls)
        still_out: dict[str, str] = {}
        cut_out_unreachable = cutting_out(
            cut_out_unreachable, self.config.cut_out_unreachable, collective=sender is not None
        )
        if cut_out_unreachable:
            first_calls = ServerWeightCalls(self._core, lease_seconds, CLEANUP_SECONDS)
            servers, still_out = await first_calls.reachable(servers)
        starting = await wait_while_starting(self._core.channel, servers, wait_for_starting)
        if starting:
            log.info("still starting after %.0f s, updated anyway: %s", wait_for_starting, starting)

        async def attempt(addresses: Sequence[str], calls: ServerWeightCalls) -> WeightUpdateResult:
            plan = await make_plan(
                addresses,
                weight_version,
                self.local.last_pushed if delta else None,
                collective=sender is not None,
                compress=compress_patches,
                sending=Sending(chunk_bytes, bucket_bytes, checksums, timeout),
                state=calls.state,
            )
            if sender is None:
                states = await calls.known_states(addresses)
                fanout, fast = self.config.weight_relay_fanout, self.delivery.pace.fast
                calls.relay = relay_for(plan, states, fanout, fast)

            async def transfer(reached: Sequence[str]) -> dict[str, BaseException]:
                if sender is not None:
                    return await self.delivery.broadcast(plan, sender, reached, tensors)
                return await self.delivery.push(
                    plan, reached, tensors, calls.push_sockets, calls.relay, calls.one_stream
                )

            commits, phases = await self._commit(
                plan, calls, transfer, tensors, delta, release_memory
            )
            return WeightUpdateResult(
                commits,
                bytes_sent=self.local.last_sent_bytes,
                bytes_received=dict(self.local.last_push_bytes),
                relayed=calls.relay is not None,
                phases=phases,
            )

        if not cut_out_unreachable:
            return await attempt(servers, first_calls)
        # The first try plans from the states ``reachable`` just asked; a later one asks afresh.
        tries = iter([first_calls])
        fresh = functools.partial(ServerWeightCalls, self._core, lease_seconds, CLEANUP_SECONDS)
        result, cut_now = await commit_cutting_out(
            servers, lambda s: attempt(s, next(tries, None) or fresh()), self._core.cut_out
        )
        result.cut_out = {**still_out, **cut_now}
        return result

    async def _route(
        self, transport: WeightTransport | None, calls: ServerWeightCalls
    ) -> tuple[CollectiveSender | None, list[str]]:
        """How an update travels: the collective group's rank 0 (None: in-band streams) and
        the servers it reaches (in-band: the fleet as it is now; the collective: the servers
        that joined its group, formed again first if the fleet moved). ``transport`` None:
        the group if one was formed, else in-band."""
        sender = self.local.sender
        if transport is None:
            transport = "collective" if sender is not None else "grpc"
        if transport not in ("collective", "grpc"):
            raise ValueError(f"transport {transport!r}: use 'collective' or 'grpc'")
        if transport == "collective":
            if sender is None:
                raise ValueError(
                    "no collective group: call init_weight_transfer() or use transport='grpc'"
                )
            sender = await self._current_group(sender, calls)
            servers = list(self.local.group_servers)
        else:
            sender, servers = None, await self._core.control_servers()
        if not servers:
            raise ValueError("update_weights: the client has no server addresses")
        return sender, servers

    async def _commit(
        self,
        plan: UpdatePlan,
        calls: ServerWeightCalls,
        transfer: Callable[[Sequence[str]], Awaitable[dict[str, BaseException]]],
        tensors: list[tuple[str, Any]],
        delta: bool,
        release: bool,
    ) -> tuple[dict[str, WeightCommit], UpdatePhases]:
        """Runs the update as one fleet-wide transaction, then keeps what was pushed as the
        base of the next delta; returns each server's commit and the phases' seconds."""
        # A first record (none to copy into) is all new memory: cloned in a thread beside the
        # transfer, not after the commit (faulting in the 0.3B model's 1.1 GB took 4.3 s on its
        # VM). A later record copies into the previous one, which the transfer reads, so only
        # after the commit. Memory reserved for it (``reserve_delta_base``) is written instead,
        # and taken: a thread given up on below may still be writing into it.
        phases = UpdatePhases()
        fresh_record = None
        if delta and plan.base is None:
            reserved, self.local.reserved_record = self.local.reserved_record, None
            fresh_record = asyncio.ensure_future(
                asyncio.to_thread(PushedWeights.after, None, plan.version, tensors, reserved)
            )
        try:
            commits = await run_weight_transaction(
                plan.servers, plan.version, calls, transfer, release=release, phases=phases
            )
        except BaseException:
            if fresh_record is not None:
                fresh_record.cancel()  # its thread ends on its own; the copy is dropped
            raise
        self.local.last_pushed = None
        with phases.timed("record"):
            if fresh_record is not None:
                self.local.last_pushed = await fresh_record
            elif delta:
                self.local.last_pushed = PushedWeights.after(plan.base, plan.version, tensors)
        return commits, phases

    async def reserve_delta_base(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Allocates now, e.g. at the trainer's start, the copy of the pushed weights this
        client keeps as the base of deltas (``update_weights(delta=True)``, the default): a
        zeroed tensor like each of ``named_tensors`` (``model.state_dict().items()``), on its
        device. The first update copies into it instead of cloning into fresh memory, which
        it would fault in while it sends: ~1.7 s of the 0.3B benchmark model's first
        update on its 2-core VM. Only shapes, types and devices are read, never values; a
        tensor the first update pushes with another shape is cloned as before. For CUDA
        tensors it also pins the host memory their in-band bytes go through
        (``weight_sending.HostStaging``): pinning 1.17 GB took 0.95 s on an H200's host."""
        tensors = list(named_tensors)
        self.local.reserved_record = await asyncio.to_thread(reserve_record, tensors)
        if on_gpu := cuda_bytes(tensors):
            await asyncio.to_thread(self.local.host_staging.reset, on_gpu)

    async def _current_group(
        self, sender: CollectiveSender, calls: ServerWeightCalls
    ) -> CollectiveSender:
        """The collective group, formed again first if the fleet moved since it formed (a
        server restarted, so it is in no group or another one; one added or removed), with
        the same backend and rendezvous address. A server that does not answer is left for
        the update to report. The servers' answers (``calls.state``) serve the plan too."""
        servers = await self._core.control_servers()
        answers = await asyncio.gather(*(calls.state(a) for a in servers), return_exceptions=True)
        states = [a for a in answers if isinstance(a, ServerState)]
        if len(states) < len(servers):
            return sender
        rendezvous = (sender.master_address, sender.master_port)
        left = [a for a, state in zip(servers, states, strict=True) if state.group != rendezvous]
        if not left and set(servers) == set(self.local.group_servers):
            return sender
        log.info(
            "the fleet moved since the %s group formed (not in it: %s; was %s, is %s): forming "
            "it again",
            sender.backend,
            left,
            self.local.group_servers,
            servers,
        )
        await self.init_weight_transfer(
            sender.backend,
            master_address=sender.master_address,
            group_name=sender.group_name,
            timeout_seconds=sender.timeout_seconds,
        )
        assert self.local.sender is not None
        return self.local.sender

    async def cancel_weight_update(self, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Cancels the weight update open on any server (e.g. one a crashed trainer left);
        returns the parameters each server dropped (0 where none was open)."""
        deadline = self._core.deadline("control", timeout)

        async def cancel(address: str) -> int:
            try:
                response = await self._core.unary(
                    address,
                    self._core.control(address).CancelWeightUpdate,
                    cp.CancelWeightUpdateRequest(),
                    deadline,
                    plane="control",
                )
            except FailedPrecondition:
                return 0  # nothing open there
            return response.parameters_discarded

        return await fan_out("CancelWeightUpdate", await self._core.control_servers(), cancel)

    async def rollback_weights(
        self, weight_version: int, *, timeout: Timeout = DEFAULT
    ) -> dict[str, int]:
        """On every server, undoes the commit of ``weight_version`` (possible until the next
        update starts, unless it was made with ``release_memory=True``); returns the version each
        server serves again."""
        request = cp.RollbackWeightUpdateRequest(weight_version=weight_version)
        return await self._core.fan_out(
            lambda s: s.RollbackWeightUpdate, request, timeout, lambda r: r.weight_version
        )

    async def weight_checksums(
        self, names: Sequence[str] = (), *, timeout: Timeout = DEFAULT
    ) -> dict[str, dict[str, bytes]]:
        """SHA-256 of every server's serving weights, per parameter (checkpoint names)."""
        request = cp.GetWeightChecksumsRequest(names=list(names))
        return await self._core.fan_out(
            lambda s: s.GetWeightChecksums,
            request,
            timeout,
            lambda r: {c.name: c.sha256 for c in r.checksums},
        )

    async def weight_versions(self, *, timeout: Timeout = DEFAULT) -> WeightVersions:
        """The version each server serves; ``.consistent`` / ``.behind()`` show a mismatch
        (e.g. a restarted server back on its initial weights)."""
        request = cp.GetServerInfoRequest()
        versions = await self._core.fan_out(
            lambda s: s.GetServerInfo, request, timeout, lambda r: r.weight_version
        )
        return WeightVersions(versions)
