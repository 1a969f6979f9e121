"""A server catching up with its fleet before it serves: the weights the fleet serves now,
read from a peer (``ControlPlane/ReadWeights``: a manifest with every parameter's SHA-256, then
CRC-checked chunks) and committed here through the same update path a trainer's push takes;
then the peer's LoRA adapters (``ReadLoraAdapter``, the same form), each loaded here through
the path a LoadLoraAdapter upload takes, at the peer's version.

A restarted or added server is started with its peers' addresses (``--catch-up-from``, and
``--peer-tls-*`` when they serve TLS); the engine server runs this after its warm-up and before
it reports SERVING, so no router or client sends it anything while it is behind, and the
trainer is not involved. The peer with the newest version is read (the next one on failure);
with no peer ahead, or none reachable, the server serves what it has, and the log says so. A
fleet update in flight on a peer is waited out before reading, and the peers are asked again
after it: what this server serves is what the fleet committed last, not the version before.
Adapters come from the peer read (or the newest one answering), when this server serves LoRA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from servers.engine.domain.lora_adapters import AdapterManager, AdapterUpload
from servers.engine.domain.weights.serving import ServingWeights
from servers.engine.peers.peer_streams import PeerAccess, stage_stream
from servers.engine.peers.stream_items import adapter_item, adapter_spec, read_item
from servers.engine.transfer.specs import Manifest
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import SkyrlError
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc

log = logging.getLogger(__name__)

# How long a peer gets to say which version it serves, or which adapters it holds.
PEER_INFO_SECONDS = 10.0
# How long reading the whole weights (or one adapter) from a peer may take.
READ_SECONDS = 600.0
# How long a catch-up waits for a fleet update in flight on a peer to commit or be cancelled
# (a full update takes seconds; a trainer that died holds one until its lease ends), and how
# often it asks.
SETTLE_SECONDS = 120.0
SETTLE_POLL_SECONDS = 0.2
# Times the peers are asked again after a read (a commit may land while this server reads).
CATCH_UP_ROUNDS = 3
# The owner a catch-up's own update names (on this server, read by the others).
CATCH_UP_OWNER = "catch-up from"


@dataclass(frozen=True)
class CatchUpParts:
    """What a catch-up uses on this server (built by ``process.engine_parts``): the serving
    weights, whose update path commits what is read, and the LoRA adapters."""

    weights: ServingWeights
    adapters: AdapterManager


async def catch_up(parts: CatchUpParts, peers: Sequence[str], access: PeerAccess) -> str:
    """Brings this server to the newest version its ``peers`` serve, with their adapters;
    returns what happened. A fleet update in flight on a peer is waited out first (up to
    ``SETTLE_SECONDS`` in all), and the peers are asked again once the weights are read: a
    server that read version N while the fleet committed N + 1 would otherwise serve N beside
    it until the trainer's next update."""
    weights, source = "", None
    versions: list[tuple[int, str]] = []
    settle = _PeerVersions(peers, access, asyncio.get_running_loop().time() + SETTLE_SECONDS)
    for _ in range(CATCH_UP_ROUNDS):
        versions = await settle.settled()
        ahead = any(v > parts.weights.version for v, _ in versions)
        if weights and not ahead:
            break  # current: nothing was committed while it read
        weights, read = await _catch_up_weights(parts, versions, len(peers), access)
        source = read or source
        if not ahead:
            break  # no peer ahead: nothing read, nothing to ask again
    if not parts.adapters.limits.enabled or not versions:
        return weights
    peer = source or max(versions)[1]
    try:
        adapters = await _catch_up_adapters(parts, peer, access)
    except grpc.aio.AioRpcError as error:
        adapters = f"no adapters read from {peer} ({error.code().name}: {error.details()})"
    return f"{weights}; {adapters}"


class _PeerVersions:
    """The versions the peers serve, asked when no fleet update is open on any of them."""

    def __init__(self, peers: Sequence[str], access: PeerAccess, deadline: float) -> None:
        self._peers = peers
        self._access = access
        self._deadline = deadline  # the event loop's time when waiting stops
        self._said: set[str] = set()  # what was logged already: once each

    async def settled(self) -> list[tuple[int, str]]:
        """The version each peer that answers serves, asked once none holds a fleet update
        open (another server's catch-up is not one), or once the deadline passed (then the
        log says so: this server may serve a version behind until the trainer's next
        update)."""
        async with contextlib.AsyncExitStack() as stack:  # one channel per peer while asking
            stubs = {
                peer: control_plane_pb2_grpc.ControlPlaneStub(
                    await stack.enter_async_context(self._access.channel(peer))
                )
                for peer in self._peers
            }
            return await self._ask_until_settled(stubs)

    async def _ask_until_settled(
        self, stubs: Mapping[str, control_plane_pb2_grpc.ControlPlaneAsyncStub]
    ) -> list[tuple[int, str]]:
        loop = asyncio.get_running_loop()
        while True:
            infos = await asyncio.gather(*(self._info(p, stub) for p, stub in stubs.items()))
            answers = list(zip(stubs, infos, strict=True))
            versions = [(info.weight_version, peer) for peer, info in answers if info is not None]
            updating = [
                (peer, info.open_weight_update)
                for peer, info in answers
                if info is not None
                and info.HasField("open_weight_update")
                and not info.open_weight_update.owner.startswith(CATCH_UP_OWNER)
            ]
            if not updating:
                return versions
            if loop.time() > self._deadline:
                log.warning(
                    "catch-up: %s still updating after %.0f s: reading what they serve now",
                    ", ".join(peer for peer, _ in updating),
                    SETTLE_SECONDS,
                )
                return versions
            for peer, update in updating:
                self._say(
                    f"waiting {peer}",
                    f"catch-up: waiting for {peer}'s weight update (version "
                    f"{update.weight_version}, by {update.owner}) to end",
                )
            await asyncio.sleep(SETTLE_POLL_SECONDS)

    async def _info(
        self, peer: str, stub: control_plane_pb2_grpc.ControlPlaneAsyncStub
    ) -> cp.GetServerInfoResponse | None:
        """``peer``'s GetServerInfo, or None where it does not answer."""
        try:
            info: cp.GetServerInfoResponse = await stub.GetServerInfo(
                cp.GetServerInfoRequest(), metadata=self._access.metadata, timeout=PEER_INFO_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            self._say(
                f"silent {peer}", f"catch-up: peer {peer} did not answer ({error.code().name})"
            )
            return None
        return info

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.info("%s", message)


async def _catch_up_weights(
    parts: CatchUpParts, versions: list[tuple[int, str]], asked: int, access: PeerAccess
) -> tuple[str, str | None]:
    """Reads the newest weights a peer serves; what happened, and the peer read (if any)."""
    current = parts.weights.version
    ahead = sorted((v for v in versions if v[0] > current), reverse=True)
    if not ahead:
        return (
            f"no peer serves newer weights than version {current} (asked {asked}, "
            f"{len(versions)} answered)"
        ), None
    for version, peer in ahead:
        try:
            read = await _read_from(parts, peer, access)
        except Exception as error:  # the next peer, or behind
            log.warning("catch-up from %s (version %d) failed: %s", peer, version, error)
            continue
        return f"caught up from {peer}: version {read}", peer
    return (
        f"stays behind on version {current}: no peer ahead ({len(ahead)}) could be read; the "
        "trainer's next update brings it the whole weights"
    ), None


async def _read_from(parts: CatchUpParts, peer: str, access: PeerAccess) -> int:
    """Reads ``peer``'s weights and commits them here as its version; returns it."""
    async with access.channel(peer) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        call = stub.ReadWeights(
            cp.ReadWeightsRequest(), metadata=access.metadata, timeout=READ_SECONDS
        )
        messages = call.__aiter__()
        first = await messages.__anext__()
        version = first.weight_version

        async def items() -> AsyncIterator[tuple[None, Manifest | WireChunk]]:
            yield None, read_item(first)
            async for message in messages:
                yield None, read_item(message)

        updates = parts.weights.updates
        await updates.start(version, owner=f"{CATCH_UP_OWNER} {peer}")
        try:
            # The path every weight stream takes (here nothing is forwarded).
            outcome = await stage_stream(items(), updates.push)
            if outcome.error is not None:
                raise outcome.error
            await updates.finish(version)
        except BaseException:
            if updates.open is not None:
                await updates.cancel()
            raise
    return version


async def _catch_up_adapters(parts: CatchUpParts, peer: str, access: PeerAccess) -> str:
    """Loads every adapter ``peer`` serves that this server does not serve at its version."""
    manager = parts.adapters
    have = {(a.name, a.version) for a in manager.serving()}
    loaded: list[str] = []
    async with access.channel(peer) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        listed = await stub.ListLoraAdapters(
            cp.ListLoraAdaptersRequest(), metadata=access.metadata, timeout=PEER_INFO_SECONDS
        )
        for adapter in listed.adapters:
            if (adapter.name, adapter.version) in have:
                continue
            call = stub.ReadLoraAdapter(
                cp.ReadLoraAdapterRequest(name=adapter.name),
                metadata=access.metadata,
                timeout=READ_SECONDS,
            )
            try:
                upload: AdapterUpload | None = None
                async for message in call:
                    if upload is None:
                        upload = manager.upload(adapter_spec(message))
                    else:
                        upload.add(adapter_item(message))
                if upload is not None:
                    await manager.load(upload)
                    loaded.append(f"{adapter.name} v{adapter.version}")
            except (grpc.aio.AioRpcError, SkyrlError) as error:  # the others still load
                call.cancel()
                log.warning("catch-up: adapter %s from %s failed: %s", adapter.name, peer, error)
    return f"adapters from {peer}: {', '.join(loaded) or 'none needed'}"
