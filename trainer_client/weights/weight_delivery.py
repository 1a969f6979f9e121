"""How an update's bytes reach the servers, for ``weight_updates``: broadcasts over the
collective group (a group of patches at a time, or the whole weights) and PushWeights streams
(patches, compressed patches or whole values per server), the trainer's preparation of the
next group overlapping the transfer of this one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from skyrl_grpc.metadata import RELAY_TREE
from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.push_socket_client import host_of
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
from trainer_client.weights.relay_plan import RelayPace, RelayPlan
from trainer_client.weights.update_plan import (
    WHOLE,
    PushedWeights,
    UpdatePlan,
    Variant,
)
from trainer_client.weights.update_shares import OneAhead, Shares, chunk_bytes_for
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

# Source bytes whose patches one UpdateWeights call broadcasts (``WeightDelivery.broadcast``):
# a call and its broadcasts cost milliseconds, and the next group's patches are computed
# meanwhile.
BROADCAST_GROUP_BYTES = 256 << 20

log = logging.getLogger(__name__)


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


class WeightDelivery:
    """Sending an update's bytes over ``core``'s channels (``WeightUpdates`` owns one), counting
    them in ``local``."""

    def __init__(self, core: ClientCore, local: LocalWeights) -> None:
        self._core = core
        self._local = local
        # How fast relayed streams ran: ``auto`` relays on fast links down trees.
        self.pace = RelayPace()

    async def broadcast(
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
        one group ahead of the broadcast (as ``push`` does); whole weights go as one call."""
        self._local.last_push_bytes = dict.fromkeys(addresses, 0)
        self._local.last_sent_bytes = 0
        if plan.base is not None and plan.all_patched(addresses):
            compress = plan.compressing.issuperset(addresses)
            failures = await self.broadcast_groups(
                plan, sender, addresses, tensors, plan.base, compress
            )
            if not any(isinstance(f, FailedPrecondition) for f in failures.values()):
                return failures
            log.info("a server refused the patches (its version moved): broadcasting it all")
        return await self.broadcast_groups(plan, sender, addresses, tensors, None, False)

    async def broadcast_groups(
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
                failures = await self.broadcast_buckets(sender, addresses, buckets, sending.timeout)
                if failures:
                    return failures
            return {}
        finally:
            prepared.cancel()

    async def broadcast_buckets(
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
            return await self._core.unary(
                address,
                self._core.control(address).UpdateWeights,
                request,
                timeout,
                plane="control",
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

    async def push(
        self,
        plan: UpdatePlan,
        addresses: Sequence[str],
        tensors: list[tuple[str, Any]],
        sockets: Mapping[str, PushSocketOffer],
        relay: RelayPlan | None = None,
        one_stream: Callable[[str], bool] = lambda address: False,
    ) -> dict[str, BaseException]:
        """Pushes to every server: a patch against the plan's base where the server serves its
        version (compressed where the plan says), the whole weights elsewhere, and to a
        server that refuses the patch (its version moved). The tensors go in groups of
        ``PUSH_GROUP_BYTES``: a worker thread prepares the next group (its patches, checksums)
        while the current one is sent, so the trainer's work overlaps the transfer and the
        servers' instead of preceding them. Each group is prepared once for all servers; a group
        with nothing changed sends nothing. A server that takes streams of several manifests
        (``one_stream``) gets its groups back to back in one stream, so no group waits for the
        one before it to be answered; an older server gets a stream per group. A server that
        offered a push socket for this update (``sockets``) gets the streams over it, else over
        gRPC.

        With a ``relay`` plan each group of servers' update is split into one share per relay
        tree (``relay_plan``): each share goes to its tree's root alone, as one stream naming
        its tree, all shares at once, and the servers forward them down their trees. A server
        in a tree that refuses the patches gets the whole weights from the trainer afterwards,
        directly. Any other failure in a tree is that server's (the transaction cancels the
        update everywhere, naming it)."""
        base, sending = plan.base, plan.sending
        # CUDA tensors' bytes reach the host through page-locked memory kept for them.
        on_gpu = cuda_bytes(tensors)
        staging = self._local.host_staging if on_gpu else None
        if staging is not None:
            await asyncio.to_thread(staging.reset, on_gpu)
        shares = Shares(tensors)

        def make(variant: Variant, share: tuple[int, int], across: bool, index: int) -> PushStream:
            patched, compress = variant
            group = shares.groups(*share)[index]
            chunk = chunk_bytes_for(sending.chunk_bytes, shares.bytes(*share), across)
            if patched:
                assert base is not None
                entries = weight_patches(
                    group, base.tensors, base.version, sending.checksums, compress
                )
            else:
                entries = tensor_entries(group, sending.checksums)
            return PushStream(entries, chunk, staging)

        # Each (variant, share, across hosts or not) prepared once for every server that takes it,
        # when one asks.
        prepared: dict[tuple[Variant, tuple[int, int], bool], OneAhead[PushStream]] = {}

        def source(variant: Variant, share: tuple[int, int], across: bool) -> OneAhead[PushStream]:
            key = (variant, share, across)
            if key not in prepared:
                count = len(shares.groups(*share))
                prepared[key] = OneAhead(functools.partial(make, *key), count)
            return prepared[key]

        local = self._local
        local.last_push_bytes = dict.fromkeys(addresses, 0)
        local.last_sent_bytes = 0
        failures: dict[str, BaseException] = {}
        refused: dict[str, ServerError] = {}
        loop = asyncio.get_running_loop()

        async def send_all(
            address: str,
            variant: Variant,
            share: tuple[int, int],
            tree: int | None,
            reached: Sequence[str],
        ) -> None:
            """A share's groups to ``address`` (relayed to ``reached`` below it, down relay
            tree ``tree``); the servers below that refused the patches are left in
            ``refused``."""
            across = len({host_of(member) or member for member in reached}) > 1
            groups = source(variant, share, across)
            count = len(shares.groups(*share))

            async def group(index: int) -> PushStream | None:
                sent = await groups.get(index)
                if sent.empty:
                    return None
                local.last_sent_bytes += sent.wire_bytes
                for member in reached:
                    local.last_push_bytes[member] += sent.total_bytes
                return sent

            first, after = None, count
            for index in range(count):
                if (first := await group(index)) is not None:
                    after = index + 1
                    break
            if first is None:
                return  # nothing of this share changed: nothing to send

            def each_group() -> Iterator[PushStream]:  # in the sending thread
                yield first
                for index in range(after, count):
                    sent = asyncio.run_coroutine_threadsafe(group(index), loop).result()
                    if sent is not None:
                        yield sent

            async def streams() -> AsyncIterator[PushStream]:
                yield first
                for index in range(after, count):
                    if (sent := await group(index)) is not None:
                        yield sent

            async def messages() -> AsyncIterator[bytes]:
                async for sent in streams():
                    for message in sent:
                        yield message

            lane = await open_push_socket(address, sockets.get(address), sending.timeout, tree)
            metadata = ((RELAY_TREE, str(tree)),) if tree is not None else ()
            try:
                if one_stream(address):
                    if lane is not None:
                        await asyncio.to_thread(lane.send_chain, each_group())
                    else:
                        await self._core.unary(
                            address,
                            self._push_method(address),
                            messages(),
                            sending.timeout,
                            plane="control",
                            metadata=metadata,
                        )
                    return
                async for sent in streams():  # an older server: a stream per group
                    if lane is not None:
                        await asyncio.to_thread(lane.send, sent)
                    else:
                        await self._core.unary(
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
                # Refused before anything of that stream was staged there: each gets the whole
                # weights next (whole tensors staged by earlier streams are staged again).
                refused.update(below)
            finally:
                if lane is not None:
                    lane.close()  # a send still running in its thread fails at once

        async def push(target: tuple[str, Variant, tuple[int, int], int | None, list[str]]) -> None:
            address, variant, share, tree, reached = target
            began = time.monotonic()
            try:
                await send_all(address, variant, share, tree, reached)
            except RelayFailed as failed:
                failures.update(failed.failures)
                return
            if tree is not None and variant == WHOLE:  # what the links' pace allows
                self.pace.observe(shares.bytes(*share), time.monotonic() - began)

        targets: list[tuple[str, Variant, tuple[int, int], int | None, list[str]]] = []
        for trees in relay.groups if relay is not None else ():
            for index, tree in enumerate(trees):
                root = tree.root
                shared = (index, len(trees))
                targets.append((root, plan.variant(root), shared, index, tree.subtree(root)))
        for address in addresses:
            if relay is None or not relay.relays(address):
                targets.append((address, plan.variant(address), (0, 1), None, [address]))
        try:
            outcomes = await asyncio.gather(*(push(t) for t in targets), return_exceptions=True)
            for target, outcome in zip(targets, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    failures.update({member: outcome for member in target[4]})
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
                        await send_all(address, WHOLE, (0, 1), None, [address])
                    except RelayFailed as failed:
                        failures.update(failed.failures)

                failures.update(await failures_of(moved, whole))
            return failures
        finally:
            for ahead in prepared.values():
                ahead.cancel()

    def _push_method(
        self, address: str
    ) -> grpc.aio.StreamUnaryMultiCallable[bytes, cp.PushWeightsResponse]:
        return self._core.channel(address).stream_unary(
            PUSH_WEIGHTS,
            request_serializer=None,
            response_deserializer=cp.PushWeightsResponse.FromString,
        )


def _only_refused_patches(failures: Mapping[str, ServerError]) -> bool:
    """Whether every failure is a server refusing the patches (its version moved)."""
    return all(isinstance(error, FailedPrecondition) for error in failures.values())
