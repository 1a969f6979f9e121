"""Weights on every server of the fleet: the collective group, updates as fleet-wide
transactions (``weight_transaction``), cancel, rollback, checksums and versions.

How bytes move is ``trainer_client.weight_sending`` (buckets over the collective group, or chunks
over gRPC streams); this module makes the calls around them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import grpc

from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.process_group import free_port
from skyrl_grpc.v1 import control_plane_pb2 as cp

from .client_core import ClientCore, ControlRpc, Request, Response
from .exceptions import FailedPrecondition
from .fanout import failures_of, fan_out
from .fleet_info import WeightCommit
from .results import WeightVersions
from .weight_sending import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    Bucket,
    CollectiveSender,
    PushStream,
    plan_buckets,
    push_groups,
    rank_offsets,
    tensor_entries,
    weight_patches,
)
from .weight_transaction import run_weight_transaction

# Source bytes of the tensors in one PushWeights stream (see ``_push``): big enough that a
# stream's own cost (a manifest, a round trip) is negligible, small enough that preparing the
# next group overlaps sending this one.
PUSH_GROUP_BYTES = 64 << 20
# Source bytes whose patches one UpdateWeights call broadcasts (see ``_broadcast``): a call and
# its broadcasts cost milliseconds, and the next group's patches are computed meanwhile.
BROADCAST_GROUP_BYTES = 256 << 20

log = logging.getLogger(__name__)
T = TypeVar("T")
WeightTransport = Literal["collective", "grpc"]


def owner_name() -> str:
    """How this process names itself to the servers (in weight-update leases)."""
    return f"trainer@{socket.gethostname()}:{os.getpid()}"


class WeightUpdates(ClientCore):
    """Weight calls (mixin of ``InferenceClient``)."""

    def _setup_weights(self) -> None:
        # Rank 0 of the collective weight-transfer group (process-local, never pickled).
        self._sender: CollectiveSender | None = None
        # The weights last committed in-band, the base of the next update's patches
        # (process-local, never pickled): one copy of each pushed tensor, on its device.
        self._last_pushed: _PushedWeights | None = None
        # Bytes of parameter data the last update sent to each server.
        self.last_push_bytes: dict[str, int] = {}

    @property
    def has_weight_group(self) -> bool:
        """True once ``init_weight_transfer`` formed the collective group."""
        return self._sender is not None

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
        rank offset (computed from the servers' world sizes). Returns each server's offset."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl' (in-band needs no group)")
        request = cp.GetServerInfoRequest()
        sizes = await self._fan_out(lambda s: s.GetServerInfo, request, None, _world_size)
        servers = list(self.config.servers)
        offsets, world_size = rank_offsets([sizes[a] for a in servers])
        port = master_port or free_port(master_address)
        sender = CollectiveSender(
            backend, master_address, port, world_size, group_name, timeout_seconds
        )
        by_server = dict(zip(servers, offsets, strict=True))
        proto_backend = (
            cp.WEIGHT_TRANSFER_BACKEND_GLOO
            if backend == "gloo"
            else cp.WEIGHT_TRANSFER_BACKEND_NCCL
        )

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
                return await self._unary(
                    address, self._control(address).InitWeightTransfer, request, timeout_seconds
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
        self._sender = sender
        return by_server

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        weight_version: int | None = None,
        *,
        transport: WeightTransport | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksums: bool = False,
        timeout: float = 600.0,
        lease_seconds: int = 0,
        delta: bool = True,
        compress_patches: bool = False,
    ) -> dict[str, WeightCommit]:
        """Pushes new weights to every server and commits ``weight_version`` on all of them,
        or on none: a fleet-wide transaction (``trainer_client.weight_transaction``).

        ``weight_version``: what the new weights serve as; must be newer than what every server
        serves, and is checked before any weight is sent. None: one more than the newest
        version any server serves. ``transport``: "collective" (the group from
        ``init_weight_transfer``) or "grpc" (in-band streams, no group needed); None: the
        group if one was formed, else "grpc". ``checksums``: also send every parameter's
        SHA-256, which each server checks on what it assembled (after applying a patch): an
        end-to-end proof that costs about a second per GB on each side. Without it in-band
        chunks are still CRC-32-checked and patches apply only to the version they name;
        ``weight_checksums()`` gives the same proof on demand. ``timeout``: seconds for the
        transfer.
        ``lease_seconds``: how long the servers keep the update open if this process dies
        mid-way (0: their default). ``delta``: send only what changed since the version
        this client pushed last (``weight_sending.weight_patches``), to each server serving
        it; a server on another version gets the whole weights in the same transaction
        (in-band: that server alone; over the collective, whose broadcasts reach every
        server: all of them). The client then keeps a copy of the weights it pushed (on their
        device: one model's bytes of GPU or host memory), the base of the next delta;
        ``delta=False`` keeps none. ``compress_patches``: patches travel zstd-compressed
        (indices as gaps, values as XORs with the base: an RL step's patch shrinks 3-5x), for
        links slower than the CPUs: compressing costs the trainer CPU time once, decompressing
        each server less (``patch_format``; measured in docs/bench-weight-sync.md). A server
        that does not take them (older than this client) gets its patches uncompressed (over
        the collective, whose broadcasts reach every server: all of them).

        On any failure (a server unreachable, a rejected chunk or version, a timeout) the update
        is cancelled on every server and rolled back where it was already committed, then
        ``WeightUpdateError`` names each server, what happened there and the version it serves
        now. Returns each server's answer to the commit (the version, parameters replaced).
        """
        tensors = list(named_tensors)
        servers = list(self.config.servers)
        sender = self._sender
        if transport is None:
            transport = "collective" if sender is not None else "grpc"
        if transport not in ("collective", "grpc"):
            raise ValueError(f"transport {transport!r}: use 'collective' or 'grpc'")
        if transport == "collective" and sender is None:
            raise ValueError(
                "no collective group: call init_weight_transfer() or use transport='grpc'"
            )
        if not servers:
            raise ValueError("update_weights: the client has no server addresses")
        if weight_version is not None and weight_version <= 0:
            # 0 means "unset" on the wire and every server starts at 0: refused before a byte
            # moves, instead of after the whole model was pushed.
            raise ValueError(
                f"weight_version={weight_version}: versions start at 1 and must increase "
                "(None: one more than the newest version any server serves)"
            )
        calls = _TransactionCalls(self, lease_seconds)
        in_band = not (sender is not None and transport == "collective")
        base = self._last_pushed if delta else None
        # What each server serves, from those that answer (one that does not fails the update
        # at its start, where the error reports every server): asked once, when the version
        # is to be chosen or a delta's base is to be matched.
        serving: dict[str, int] = {}
        if weight_version is None or base is not None:
            answers = await asyncio.gather(
                *(calls.serving_version(a) for a in servers), return_exceptions=True
            )
            serving = {a: v for a, v in zip(servers, answers, strict=True) if isinstance(v, int)}
        if weight_version is None:
            weight_version = 1 + max(serving.values(), default=0)

        # Who takes compressed patches: asked with the serving versions (a delta needs those).
        compressing = calls.reading_compressed if compress_patches and base is not None else set()
        if compress_patches and base is not None and set(servers) - compressing:
            log.info(
                "%s do not take compressed patches: they get theirs uncompressed",
                ", ".join(sorted(set(servers) - compressing)),
            )

        async def transfer(addresses: Sequence[str]) -> dict[str, BaseException]:
            if not in_band:
                assert sender is not None
                # One broadcast reaches every server: patches only when all serve the base.
                patched = base is not None and all(
                    serving.get(a) == base.version for a in addresses
                )
                return await self._broadcast(
                    sender,
                    addresses,
                    tensors,
                    base if patched else None,
                    bucket_bytes,
                    checksums,
                    compressing.issuperset(addresses),
                    timeout,
                )
            return await self._push(
                addresses, tensors, base, serving, chunk_bytes, checksums, compressing, timeout
            )

        commits = await run_weight_transaction(servers, weight_version, calls, transfer)
        self._last_pushed = None
        if delta:
            self._last_pushed = _PushedWeights.after(base, weight_version, tensors)
        return commits

    async def _broadcast(
        self,
        sender: CollectiveSender,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        base: _PushedWeights | None,
        bucket_bytes: int,
        checksums: bool,
        compress: bool,
        timeout: float,
    ) -> dict[str, BaseException]:
        """Broadcasts to every server: patches against ``base`` (when given), else the whole
        weights, and the whole weights again if a server refuses the patches (its version
        moved: the others stage the whole values over their patches). Patches are computed a
        group at a time, one group ahead of the broadcast (as ``_push`` does); whole weights go
        as one call."""
        self.last_push_bytes = dict.fromkeys(addresses, 0)
        if base is not None:
            failures = await self._broadcast_groups(
                sender, addresses, tensors, base, bucket_bytes, checksums, compress, timeout
            )
            if not any(isinstance(f, FailedPrecondition) for f in failures.values()):
                return failures
            log.info("a server refused the patches (its version moved): broadcasting it all")
        return await self._broadcast_groups(
            sender, addresses, tensors, None, bucket_bytes, checksums, compress, timeout
        )

    async def _broadcast_groups(
        self,
        sender: CollectiveSender,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        base: _PushedWeights | None,
        bucket_bytes: int,
        checksums: bool,
        compress: bool,
        timeout: float,
    ) -> dict[str, BaseException]:
        groups = push_groups(tensors, BROADCAST_GROUP_BYTES) if base is not None else [tensors]

        def make(index: int) -> list[Bucket]:
            if base is None:
                return plan_buckets(tensor_entries(groups[index], checksums), bucket_bytes)
            entries = weight_patches(groups[index], base.tensors, base.version, checksums, compress)
            return plan_buckets(entries, bucket_bytes)

        prepared = _OneAhead(make, len(groups))
        try:
            for index in range(len(groups)):
                buckets = await prepared.get(index)
                if not buckets:
                    continue  # nothing of this group changed
                failures = await self._broadcast_buckets(sender, addresses, buckets, timeout)
                if failures:
                    return failures
            return {}
        finally:
            prepared.cancel()

    async def _broadcast_buckets(
        self,
        sender: CollectiveSender,
        addresses: Sequence[str],
        buckets: list[Bucket],
        timeout: float,
    ) -> dict[str, BaseException]:
        request = cp.UpdateWeightsRequest(buckets=[b.layout for b in buckets])
        for address in addresses:  # what each server receives (every one gets every bucket)
            self.last_push_bytes[address] += sum(b.layout.size_bytes for b in buckets)

        async def update(address: str) -> object:
            return await self._unary(
                address, self._control(address).UpdateWeights, request, timeout
            )

        # Every server receives while rank 0 broadcasts; a server that rejects the layout still
        # receives (and drops) the bytes, so the broadcast completes.
        broadcast = asyncio.ensure_future(asyncio.to_thread(sender.broadcast, buckets))
        failures = await failures_of(addresses, update)
        try:
            await broadcast
        except Exception as error:
            failures.update({a: error for a in addresses if a not in failures})
        return failures

    async def _push(
        self,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        base: _PushedWeights | None,
        serving: dict[str, int],
        chunk_bytes: int,
        checksums: bool,
        compressing: set[str],
        timeout: float,
    ) -> dict[str, BaseException]:
        """Pushes to every server: a patch against ``base`` where the server serves its version
        (compressed to the servers in ``compressing``), the whole weights elsewhere, and to a
        server that refuses the patch (its version moved). The tensors go in groups of
        ``PUSH_GROUP_BYTES``, one PushWeights stream each (an update takes any number): a worker
        thread prepares the next group's stream (its patches, checksums) while the current one
        is sent, so the trainer's work overlaps the transfer and the servers' instead of
        preceding them. Each group is prepared once for all servers; a group with nothing
        changed sends nothing."""
        groups = push_groups(tensors, PUSH_GROUP_BYTES)

        # What a server gets: patches (compressed or not), or whole values.
        Variant = tuple[bool, bool]
        patches, compressed, whole = (True, False), (True, True), (False, False)

        def make(variant: Variant, index: int) -> PushStream:
            patched, compress = variant
            if patched:
                assert base is not None
                entries = weight_patches(
                    groups[index], base.tensors, base.version, checksums, compress
                )
            else:
                entries = tensor_entries(groups[index], checksums)
            return PushStream(entries, chunk_bytes)

        # Each variant prepared once for every server that takes it (none before one asks).
        prepared = {
            variant: _OneAhead(functools.partial(make, variant), len(groups))
            for variant in (patches, compressed, whole)
        }

        def method(
            address: str,
        ) -> grpc.aio.StreamUnaryMultiCallable[bytes, cp.PushWeightsResponse]:
            return self.channel(address).stream_unary(
                PUSH_WEIGHTS,
                request_serializer=None,
                response_deserializer=cp.PushWeightsResponse.FromString,
            )

        async def send_all(address: str, variant: Variant) -> None:
            self.last_push_bytes[address] = 0
            for index in range(len(groups)):
                sent = await prepared[variant].get(index)
                if sent.empty:
                    continue
                self.last_push_bytes[address] += sent.total_bytes
                await self._unary(address, method(address), iter(sent), timeout)

        async def push(address: str) -> None:
            patched = base is not None and serving.get(address) == base.version
            if patched:
                try:
                    await send_all(address, compressed if address in compressing else patches)
                    return
                except FailedPrecondition:
                    # Refused before anything of that stream was staged; whole tensors staged
                    # by earlier streams are staged again, whole.
                    log.info("%s refused the patch (its version moved): sending it all", address)
            await send_all(address, whole)

        self.last_push_bytes = {}
        try:
            return await failures_of(addresses, push)
        finally:
            for variant in prepared.values():
                variant.cancel()

    async def cancel_weight_update(self, *, timeout: float | None = None) -> dict[str, int]:
        """Cancels the weight update open on any server (e.g. one a crashed trainer left);
        returns the parameters each server dropped (0 where none was open)."""
        deadline = self.config.control_timeout if timeout is None else timeout

        async def cancel(address: str) -> int:
            try:
                response = await self._unary(
                    address,
                    self._control(address).CancelWeightUpdate,
                    cp.CancelWeightUpdateRequest(),
                    deadline,
                )
            except FailedPrecondition:
                return 0  # nothing open there
            return response.parameters_discarded

        return await fan_out("CancelWeightUpdate", self.config.servers, cancel)

    async def rollback_weights(
        self, weight_version: int, *, timeout: float | None = None
    ) -> dict[str, int]:
        """On every server, undoes the commit of ``weight_version`` (possible until the next
        update starts); returns the version each server serves again."""
        request = cp.RollbackWeightUpdateRequest(weight_version=weight_version)
        return await self._fan_out(
            lambda s: s.RollbackWeightUpdate, request, timeout, lambda r: r.weight_version
        )

    async def weight_checksums(
        self, names: Sequence[str] = (), *, timeout: float | None = None
    ) -> dict[str, dict[str, bytes]]:
        """SHA-256 of every server's serving weights, per parameter (checkpoint names)."""
        request = cp.GetWeightChecksumsRequest(names=list(names))
        return await self._fan_out(
            lambda s: s.GetWeightChecksums,
            request,
            timeout,
            lambda r: {c.name: c.sha256 for c in r.checksums},
        )

    async def weight_versions(self, *, timeout: float | None = None) -> WeightVersions:
        """The version each server serves; ``.consistent`` / ``.behind()`` show a mismatch
        (e.g. a restarted server back on its initial weights)."""
        request = cp.GetServerInfoRequest()
        versions = await self._fan_out(
            lambda s: s.GetServerInfo, request, timeout, lambda r: r.weight_version
        )
        return WeightVersions(versions)


class _OneAhead(Generic[T]):
    """Items ``make(index)`` prepared in a worker thread, each once, the next one started when
    one is asked for: the trainer's work on group k+1 (patches, checksums, buckets) overlaps
    the transfer of group k instead of preceding it."""

    def __init__(self, make: Callable[[int], T], count: int) -> None:
        self._make = make
        self._count = count
        self._started: dict[int, asyncio.Future[T]] = {}

    async def get(self, index: int) -> T:
        for k in (index, index + 1):
            if k < self._count and k not in self._started:
                self._started[k] = asyncio.ensure_future(asyncio.to_thread(self._make, k))
        return await self._started[index]

    def cancel(self) -> None:
        """Drops what was prepared (a failed or finished update); a preparation already running
        in its thread (at most one ahead) finishes there and is discarded."""
        for pending in self._started.values():
            pending.cancel()


@dataclass
class _PushedWeights:
    """The tensors this client last committed in-band, as ``version`` (copies, on their
    device): what the next update's patches are computed against."""

    version: int
    tensors: dict[str, Any]

    @staticmethod
    def after(
        previous: _PushedWeights | None, version: int, pushed: list[tuple[str, Any]]
    ) -> _PushedWeights:
        """The record once ``pushed`` committed as ``version``: the previous record's tensors
        (parameters not pushed this time are unchanged on the servers) with the pushed ones
        copied in. A copy goes into the previous record's tensor of the same shape, type and
        device (the previous record is dropped): no second copy of the model, no fresh memory
        to fault in every step."""
        tensors = dict(previous.tensors) if previous is not None else {}
        for name, tensor in pushed:
            source = tensor.detach()
            kept = tensors.get(name)
            if (
                kept is not None
                and kept.shape == source.shape
                and kept.dtype == source.dtype
                and kept.device == source.device
            ):
                kept.copy_(source)
            else:
                tensors[name] = source.clone()
        return _PushedWeights(version, tensors)


def _world_size(info: cp.GetServerInfoResponse) -> int:
    return info.world_size


class _TransactionCalls:
    """The per-server calls of a fleet weight update, over the client's channels."""

    def __init__(self, client: ClientCore, lease_seconds: int) -> None:
        self._client = client
        self._lease_seconds = lease_seconds
        self._owner = owner_name()
        # The servers that said they take compressed patches (``serving_version`` asks).
        self.reading_compressed: set[str] = set()

    async def start(self, address: str, version: int) -> int:
        request = cp.StartWeightUpdateRequest(
            weight_version=version, owner=self._owner, lease_seconds=self._lease_seconds
        )
        response = await self._call(address, request, lambda s: s.StartWeightUpdate)
        return response.serving_weight_version

    async def finish(self, address: str, version: int) -> WeightCommit:
        request = cp.FinishWeightUpdateRequest(weight_version=version)
        response = await self._call(address, request, lambda s: s.FinishWeightUpdate)
        return WeightCommit.from_proto(response)

    async def cancel(self, address: str) -> None:
        await self._call(address, cp.CancelWeightUpdateRequest(), lambda s: s.CancelWeightUpdate)

    async def rollback(self, address: str, version: int) -> int:
        request = cp.RollbackWeightUpdateRequest(weight_version=version)
        response = await self._call(address, request, lambda s: s.RollbackWeightUpdate)
        return response.weight_version

    async def serving_version(self, address: str) -> int:
        info = await self._call(address, cp.GetServerInfoRequest(), lambda s: s.GetServerInfo)
        if info.capabilities.compressed_weight_patches:
            self.reading_compressed.add(address)
        return info.weight_version

    async def _call(
        self, address: str, request: Request, rpc: ControlRpc[Request, Response]
    ) -> Response:
        client = self._client
        stub_method = rpc(client._control(address))
        return await client._unary(address, stub_method, request, client.config.control_timeout)
