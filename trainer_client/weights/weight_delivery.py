"""How an update's bytes reach the servers, for ``weight_updates``: broadcasts over the
collective group (a group of patches at a time, or the whole weights) and PushWeights streams
(patches, compressed patches or whole values per server), the trainer's preparation of the
next group overlapping the transfer of this one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.client_core import ClientCore
from trainer_client.exceptions import FailedPrecondition, ServerError
from trainer_client.fanout import failures_of
from trainer_client.weights.delta_patches import weight_patches
from trainer_client.weights.push_lanes import (
    PushSocketOffer,
    RelayFailed,
    open_push_socket,
    relay_failures,
)
from trainer_client.weights.relay_plan import RelayPlan
from trainer_client.weights.update_plan import (
    COMPRESSED,
    PATCHES,
    WHOLE,
    PushedWeights,
    UpdatePlan,
    Variant,
)
from trainer_client.weights.weight_sending import (
    CollectiveSender,
    HostStaging,
    PackedBucket,
    PushStream,
    cuda_bytes,
    plan_buckets,
    push_groups,
    tensor_entries,
)

# Source bytes of the tensors in one PushWeights stream (see ``_push``): big enough that a
# stream's own cost (a manifest, a round trip) is negligible, small enough that preparing the
# next group overlaps sending this one.
PUSH_GROUP_BYTES = 64 << 20
# Source bytes whose patches one UpdateWeights call broadcasts (see ``_broadcast``): a call and
# its broadcasts cost milliseconds, and the next group's patches are computed meanwhile.
BROADCAST_GROUP_BYTES = 256 << 20

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class LocalWeights:
    """The weight path's process-local state: made on first use, never pickled (a client
    pickles its config alone), so a client handed to another process starts without it."""

    # Rank 0 of the collective weight-transfer group, and the servers that joined it.
    sender: CollectiveSender | None = None
    group_servers: list[str] = field(default_factory=list)
    # The weights last committed in-band, the base of the next update's patches: one copy
    # of each pushed tensor, on its device.
    last_pushed: PushedWeights | None = None
    # Memory reserved for the first such record (``reserve_delta_base``).
    reserved_record: dict[str, Any] | None = None
    # Bytes of parameter data each server received in the last update (from the trainer or
    # relayed).
    last_push_bytes: dict[str, int] = field(default_factory=dict)
    # Bytes the trainer itself sent in the last in-band update (every message, framing
    # included): one copy of each stream however many servers it reached, when relayed.
    last_sent_bytes: int = 0
    # Page-locked host memory CUDA tensors' in-band bytes are copied into, kept between
    # updates.
    host_staging: HostStaging = field(default_factory=HostStaging)


class WeightDelivery(ClientCore):
    """Sending an update's bytes (mixin of ``InferenceClient``, under ``WeightUpdates``)."""

    @property
    def _local(self) -> LocalWeights:
        found: LocalWeights | None = self.__dict__.get("_local_weights")
        if found is None:
            found = self.__dict__["_local_weights"] = LocalWeights()
        return found

    @property
    def last_push_bytes(self) -> dict[str, int]:
        """Bytes of parameter data each server received in the last update."""
        return self._local.last_push_bytes

    @property
    def last_sent_bytes(self) -> int:
        """Bytes this client itself sent in the last in-band update (relayed: each stream
        once, whatever the fleet's size)."""
        return self._local.last_sent_bytes

    async def _broadcast(
        self,
        plan: UpdatePlan,
        sender: CollectiveSender,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
    ) -> dict[str, BaseException]:
        """Broadcasts to every server: patches against the plan's base when every server
        serves its version (one broadcast reaches them all), else the whole weights, and the
        whole weights again if a server refuses the patches (its version moved: the others
        stage the whole values over their patches). Patches are computed a group at a time,
        one group ahead of the broadcast (as ``_push`` does); whole weights go as one call."""
        self._local.last_push_bytes = dict.fromkeys(addresses, 0)
        self._local.last_sent_bytes = 0
        if plan.base is not None and plan.all_patched(addresses):
            compress = plan.compressing.issuperset(addresses)
            failures = await self._broadcast_groups(
                plan, sender, addresses, tensors, plan.base, compress
            )
            if not any(isinstance(f, FailedPrecondition) for f in failures.values()):
                return failures
            log.info("a server refused the patches (its version moved): broadcasting it all")
        return await self._broadcast_groups(plan, sender, addresses, tensors, None, False)

    async def _broadcast_groups(
        self,
        plan: UpdatePlan,
        sender: CollectiveSender,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        base: PushedWeights | None,
        compress: bool,
    ) -> dict[str, BaseException]:
        sending = plan.sending
        groups = push_groups(tensors, BROADCAST_GROUP_BYTES) if base is not None else [tensors]

        def make(index: int) -> list[PackedBucket]:
            if base is None:
                entries = tensor_entries(groups[index], sending.checksums)
            else:
                entries = weight_patches(
                    groups[index], base.tensors, base.version, sending.checksums, compress
                )
            return plan_buckets(entries, sending.bucket_bytes)

        prepared = OneAhead(make, len(groups))
        try:
            for index in range(len(groups)):
                buckets = await prepared.get(index)
                if not buckets:
                    continue  # nothing of this group changed
                failures = await self._broadcast_buckets(
                    sender, addresses, buckets, sending.timeout
                )
                if failures:
                    return failures
            return {}
        finally:
            prepared.cancel()

    async def _broadcast_buckets(
        self,
        sender: CollectiveSender,
        addresses: Sequence[str],
        buckets: list[PackedBucket],
        timeout: float,
    ) -> dict[str, BaseException]:
        request = cp.UpdateWeightsRequest(buckets=[b.layout for b in buckets])
        size = sum(b.layout.size_bytes for b in buckets)
        self._local.last_sent_bytes += size  # what rank 0 hands the collective
        for address in addresses:  # what each server receives (every one gets every bucket)
            self._local.last_push_bytes[address] += size

        async def update(address: str) -> object:
            return await self._unary(
                address, self._control(address).UpdateWeights, request, timeout, plane="control"
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
        plan: UpdatePlan,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        sockets: Mapping[str, PushSocketOffer],
        relay: RelayPlan | None = None,
    ) -> dict[str, BaseException]:
        """Pushes to every server: a patch against the plan's base where the server serves its
        version (compressed where the plan says), the whole weights elsewhere, and to a
        server that refuses the patch (its version moved). The tensors go in groups of
        ``PUSH_GROUP_BYTES``, one PushWeights stream each (an update takes any number): a worker
        thread prepares the next group's stream (its patches, checksums) while the current one
        is sent, so the trainer's work overlaps the transfer and the servers' instead of
        preceding them. Each group is prepared once for all servers; a group with nothing
        changed sends nothing. A server that offered a push socket for this update
        (``sockets``) gets the same streams over it, else over gRPC.

        With a ``relay`` plan the streams go to each relay tree's root alone, which forwards
        them down its tree; a server in it that refuses the patches gets the whole weights
        from the trainer afterwards, directly. Any other failure in a tree is that server's
        (the transaction cancels the update everywhere, naming it)."""
        base, sending = plan.base, plan.sending
        groups = push_groups(tensors, PUSH_GROUP_BYTES)
        # CUDA tensors' bytes reach the host through page-locked memory kept for them.
        on_gpu = cuda_bytes(tensors)
        staging = self._local.host_staging if on_gpu else None
        if staging is not None:
            await asyncio.to_thread(staging.reset, on_gpu)

        def make(variant: Variant, index: int) -> PushStream:
            patched, compress = variant
            if patched:
                assert base is not None
                entries = weight_patches(
                    groups[index], base.tensors, base.version, sending.checksums, compress
                )
            else:
                entries = tensor_entries(groups[index], sending.checksums)
            return PushStream(entries, sending.chunk_bytes, staging)

        # Each variant prepared once for every server that takes it (none before one asks).
        prepared = {
            variant: OneAhead(functools.partial(make, variant), len(groups))
            for variant in (PATCHES, COMPRESSED, WHOLE)
        }
        local = self._local
        local.last_push_bytes = dict.fromkeys(addresses, 0)
        local.last_sent_bytes = 0
        failures: dict[str, BaseException] = {}

        async def send_all(address: str, variant: Variant, reached: Sequence[str]) -> None:
            """Every group's stream to ``address`` (relayed to ``reached`` below it); the
            servers below that refused the patches are left in ``refused``."""
            lane = await open_push_socket(address, sockets.get(address), sending.timeout)
            try:
                for index in range(len(groups)):
                    sent = await prepared[variant].get(index)
                    if sent.empty:
                        continue
                    local.last_sent_bytes += sent.wire_bytes
                    for member in reached:
                        local.last_push_bytes[member] += sent.total_bytes
                    try:
                        if lane is not None:
                            await asyncio.to_thread(lane.send, sent)
                        else:
                            await self._unary(
                                address,
                                self._push_method(address),
                                iter(sent),
                                sending.timeout,
                                plane="control",
                            )
                    except ServerError as error:
                        below = relay_failures(error)
                        if variant is WHOLE or not _only_refused_patches(below):
                            raise RelayFailed(address, below) from error
                        # Refused before anything of that stream was staged there: each gets
                        # the whole weights next (whole tensors staged by earlier streams
                        # are staged again, whole).
                        refused.update(below)
                        if refused.keys() >= set(reached):
                            return  # every server it reaches refused: no more patches
            finally:
                if lane is not None:
                    lane.close()  # a send still running in its thread fails at once

        async def push(address: str) -> None:
            reached = relay.subtree(address) if relay is not None else [address]
            try:
                await send_all(address, plan.variant(address), reached)
            except RelayFailed as failed:
                failures.update(failed.failures)

        refused: dict[str, ServerError] = {}
        roots = [a for a in addresses if relay is None or relay.parents.get(a, "") == ""]
        try:
            failures.update(await failures_of(roots, push))
            if refused:
                log.info(
                    "%s refused the patch (their version moved): sending them it all",
                    ", ".join(sorted(refused)),
                )
                moved = [a for a in refused if a not in failures]
                for address in moved:
                    local.last_push_bytes[address] = 0

                async def whole(address: str) -> None:
                    try:
                        await send_all(address, WHOLE, [address])
                    except RelayFailed as failed:
                        failures.update(failed.failures)

                failures.update(await failures_of(moved, whole))
            return failures
        finally:
            for variant in prepared.values():
                variant.cancel()

    def _push_method(
        self, address: str
    ) -> grpc.aio.StreamUnaryMultiCallable[bytes, cp.PushWeightsResponse]:
        return self.channel(address).stream_unary(
            PUSH_WEIGHTS,
            request_serializer=None,
            response_deserializer=cp.PushWeightsResponse.FromString,
        )


def _only_refused_patches(failures: Mapping[str, ServerError]) -> bool:
    """Whether every failure is a server refusing the patches (its version moved)."""
    return all(isinstance(error, FailedPrecondition) for error in failures.values())


class OneAhead(Generic[T]):
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
