"""Weight updates the servers relay to each other, on real engine servers over real sockets:
the trainer sends each update once, to the first server of the relay chain, and every server
commits exactly what a direct push would have given it (full and delta, over the push socket
and over gRPC, and over TLS); a server killed mid-update (the chain's root, its middle, its
leaf) leaves the fleet on one version and catches up when it is back; a forged relay stream is
refused with nothing staged."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import torch
from safetensors.torch import load_file

from servers.common.listener import ServerTls
from servers.engine import options as engine_options
from servers.engine.process import engine_server
from servers.fleet.local import LocalFleet
from skyrl_grpc import push_socket_client
from skyrl_grpc.metadata import PUSH_TICKET, RELAYED_FROM
from skyrl_grpc.names import PUSH_WEIGHTS
from skyrl_grpc.push_socket_client import PushSocketConnection
from skyrl_grpc.tls import TlsConfig
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from tests.helpers.certs import make_certificates
from tests.helpers.waits import ENGINE_START_SECONDS, until
from tests.helpers.weights import next_version, perturbed
from trainer_client import InferenceClient, WeightUpdateError

pytestmark = [pytest.mark.engine]

# Small chunks: a stream of the tiny model is dozens of frames, so a server can die inside it.
SMALL_CHUNKS = 64 << 10


class RelayFleet:
    """Three engine servers as processes (one host: the relay is a chain in this order),
    restarted with a catch-up from the others when one dies."""

    def __init__(self, stack: LocalFleet, events: list[str]) -> None:
        self.stack = stack
        self.events = events
        self.servers = list(stack.addresses.servers)

    def client(self, **settings: Any) -> InferenceClient:
        return InferenceClient(self.stack.addresses.router, self.servers, **settings)


@pytest.fixture(scope="module")
def relay_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayFleet]:
    events: list[str] = []
    logs = tmp_path_factory.mktemp("relay-fleet")
    with LocalFleet(
        3, log_dir=logs, on_event=events.append, start_timeout=ENGINE_START_SECONDS
    ) as stack:
        stack.supervise()
        yield RelayFleet(stack, events)


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


async def checksums_after(
    client: InferenceClient, weights: dict[str, torch.Tensor], version: int, **options: Any
) -> tuple[Any, dict[str, dict[str, bytes]]]:
    result = await client.update_weights(weights.items(), version, **options)
    return result, await client.weight_checksums()


def nudged(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with about 1% of each tensor's elements changed: a delta's worth."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        changed = torch.rand(tensor.shape, generator=generator) < 0.01
        out[name] = torch.where(changed, tensor + 0.01, tensor)
    return out


@pytest.mark.parametrize("push_socket", [True, False], ids=["push-socket", "grpc"])
async def test_a_relayed_update_commits_what_a_direct_one_does_full_and_delta(
    relay_fleet: RelayFleet, original: dict[str, torch.Tensor], push_socket: bool
) -> None:
    """The same weights pushed directly (the trainer streams to each server) and relayed (once,
    down the chain) leave every server with bit-identical weights, whole and as a delta; the
    trainer sends each update's bytes once relayed, once per server directly."""
    servers = relay_fleet.servers
    direct = relay_fleet.client(weight_relay_fanout=0, push_socket=push_socket)
    relayed = relay_fleet.client(push_socket=push_socket)
    first = perturbed(original, seed=11)
    second = nudged(first, seed=12)
    version = await next_version(direct)

    # Whole weights, then a delta (the client's base is its last push), each way.
    sent, want_full = await checksums_after(direct, first, version)  # no base yet: whole
    full = max(sent.bytes_received.values())
    assert not sent.relayed and sent.bytes_sent > 2.9 * full  # once per server
    sent, want_delta = await checksums_after(direct, second, version + 1)
    assert not sent.relayed
    assert all(0 < received < 0.2 * full for received in sent.bytes_received.values())
    assert want_full != want_delta

    got, sums = await checksums_after(relayed, first, version + 2)  # no base yet: whole
    assert got.relayed and sorted(got) == sorted(servers)
    assert got.bytes_received == dict.fromkeys(servers, full)
    assert full <= got.bytes_sent <= 1.05 * full  # once, not once per server
    assert sums == want_full
    got, sums = await checksums_after(relayed, second, version + 3)  # a relayed patch
    patch = max(got.bytes_received.values())
    assert got.relayed and got.bytes_received == dict.fromkeys(servers, patch)
    assert 0 < patch < 0.2 * full and got.bytes_sent <= 1.05 * patch
    assert sums == want_delta
    await direct.close()
    await relayed.close()


async def test_a_server_on_another_version_gets_the_whole_weights_in_the_same_update(
    relay_fleet: RelayFleet, original: dict[str, torch.Tensor]
) -> None:
    """A delta relays to the servers on its base; a server on another version (here: one
    pushed to alone) is in a tree of its own and gets the whole weights, in one transaction."""
    servers = relay_fleet.servers
    client = relay_fleet.client()
    version = await next_version(client)
    base = perturbed(original, seed=21)
    await client.update_weights(base.items(), version)
    alone = InferenceClient(servers[1], [servers[1]])
    await alone.update_weights(perturbed(original, seed=22).items(), version + 1, delta=False)
    await alone.close()
    target = nudged(base, seed=23)
    result = await client.update_weights(target.items(), version + 2)
    assert result.relayed
    whole = result.bytes_received[servers[1]]
    assert all(result.bytes_received[a] < 0.5 * whole for a in (servers[0], servers[2]))
    sums = await client.weight_checksums()
    assert sums[servers[0]] == sums[servers[1]] == sums[servers[2]]
    await client.close()


def gone(pid: int) -> None:
    """Returns once ``pid`` is dead (a zombie, or reaped by the fleet's supervisor)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        process = psutil.Process(pid)
        while process.status() != psutil.STATUS_ZOMBIE:  # SIGKILLed: milliseconds
            time.sleep(0.001)


def kill_mid_stream(victim_pid: int, after_frames: int) -> Any:
    """A stand-in for the trainer's push socket sends that kills ``victim_pid`` (SIGKILL) once
    the trainer sent ``after_frames`` frames of the update, and waits for it to be gone."""
    send = PushSocketConnection.send
    sent = 0

    def sending(connection: PushSocketConnection, *parts: Any) -> None:
        nonlocal sent
        sent += 1
        if sent == after_frames:
            os.killpg(victim_pid, signal.SIGKILL)  # the server and its engine's processes
            gone(victim_pid)
        send(connection, *parts)

    return sending


@pytest.mark.parametrize("hop", [0, 1, 2], ids=["root", "middle", "leaf"])
async def test_a_hop_killed_mid_update_leaves_one_version_and_catches_up(
    relay_fleet: RelayFleet,
    original: dict[str, torch.Tensor],
    hop: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kill -9 of the chain's root, middle or leaf while the trainer streams an update: the
    update fails naming the dead server, every server that lives serves the version before,
    nothing half-received is committed; back, the dead one catches up from its peers to that
    same version, and the next relayed update reaches all three."""
    servers = relay_fleet.servers
    client = relay_fleet.client(weight_relay_fanout=1)
    before = await next_version(client)
    await client.update_weights(perturbed(original, seed=31).items(), before)
    sums_before = await client.weight_checksums()
    victim = servers[hop]
    pid = relay_fleet.stack.pids[hop]
    relay_fleet.events.clear()
    monkeypatch.setattr(PushSocketConnection, "send", kill_mid_stream(pid, after_frames=10))
    with pytest.raises(WeightUpdateError) as failed:
        await client.update_weights(
            perturbed(original, seed=32).items(), before + 1, chunk_bytes=SMALL_CHUNKS
        )
    monkeypatch.undo()
    assert victim in str(failed.value) and failed.value.consistent, failed.value
    assert "UNAVAILABLE" in failed.value.outcomes[victim].what, failed.value.outcomes
    for address in servers:
        if address != victim:
            assert failed.value.outcomes[address].serving_version == before
    await until(
        lambda: any("is back" in e for e in relay_fleet.events),
        ENGINE_START_SECONDS,
        f"{victim}'s restart",
    )
    versions = await client.weight_versions()
    assert dict(versions) == dict.fromkeys(servers, before)
    assert await client.weight_checksums() == sums_before
    result = await client.update_weights(perturbed(original, seed=33).items(), before + 1)
    assert result.relayed and dict(await client.weight_versions()) == dict.fromkeys(
        servers, before + 1
    )
    await client.close()


async def open_with_role(
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub, version: int, ticket: bytes, parent: str
) -> None:
    role = cp.WeightRelayRole(address="me:1", parent=parent)
    await control.StartWeightUpdate(
        cp.StartWeightUpdateRequest(
            weight_version=version, owner="relay test", push_ticket=ticket, relay=role
        )
    )


async def test_a_forged_relay_stream_is_refused_with_nothing_staged(
    relay_fleet: RelayFleet, original: dict[str, torch.Tensor]
) -> None:
    """An update whose relay plan names its parent: a stream relayed with a wrong ticket, or by
    a peer the plan does not name, over the push socket or gRPC, is refused with
    PERMISSION_DENIED and stages nothing; the parent's own stream is taken."""
    address = relay_fleet.servers[2]
    client = relay_fleet.client()
    version = await next_version(client)
    ticket = os.urandom(16)
    parent = relay_fleet.servers[1]
    host, port = push_socket_client.host_of(address), 0
    async with grpc.aio.insecure_channel(address) as channel:
        control = control_plane_pb2_grpc.ControlPlaneStub(channel)
        info = await control.GetServerInfo(cp.GetServerInfoRequest())
        assert info.capabilities.weight_relay and info.push_socket_port
        port = info.push_socket_port
        await open_with_role(control, version, ticket, parent)
        assert host is not None
        forged = [(os.urandom(16), parent), (ticket, "10.9.9.9:50051")]
        for presented, sender in forged:
            connection, hello = await asyncio.to_thread(
                PushSocketConnection.connect, host, port, presented, 30.0, sender
            )
            connection.close()
            assert hello.code == grpc.StatusCode.PERMISSION_DENIED.value[0], hello
            assert sender in hello.message or "ticket" in hello.message
        push: Any = channel.stream_unary(PUSH_WEIGHTS, request_serializer=None)
        manifest = cp.PushWeightsRequest(manifest=cp.WeightManifest()).SerializeToString()
        for metadata in (
            ((PUSH_TICKET, os.urandom(16)), (RELAYED_FROM, parent)),
            ((PUSH_TICKET, ticket), (RELAYED_FROM, "10.9.9.9:50051")),
            ((RELAYED_FROM, parent),),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await push(iter([manifest]), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        opened = (await control.GetServerInfo(cp.GetServerInfoRequest())).open_weight_update
        assert (opened.parameters_staged, opened.bytes_received) == (0, 0)
        # The parent it names is let in.
        connection, hello = await asyncio.to_thread(
            PushSocketConnection.connect, host, port, ticket, 30.0, parent
        )
        connection.close()
        assert hello.code == 0, hello
        await control.CancelWeightUpdate(cp.CancelWeightUpdateRequest())
    assert (await client.weight_versions())[address] == version - 1
    await client.close()


@pytest.fixture(scope="module")
async def tls_fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[list[str], TlsConfig]]:
    certs = make_certificates(tmp_path_factory.mktemp("relay-certs"))
    mutual = ServerTls(certs.server_cert, certs.server_key, client_ca=certs.ca)
    as_client = TlsConfig(certs.ca, certs.client_cert, certs.client_key)
    servers = [
        engine_server.EngineServer(engine_options.ServerOptions(tls=mutual, peer_tls=as_client))
        for _ in range(3)
    ]
    try:
        for server in servers:  # one at a time: vLLM's metrics registry is the process's
            await server.start()
            await asyncio.wait_for(server.wait_ready(), timeout=ENGINE_START_SECONDS)
        yield [s.address for s in servers], as_client
    finally:
        await asyncio.gather(*(s.drain(grace=0) for s in servers))


async def test_servers_serving_tls_relay_over_tls(
    tls_fleet: tuple[list[str], TlsConfig], original: dict[str, torch.Tensor]
) -> None:
    """Servers on mutual TLS (no push socket) relay over gRPC with their peer TLS settings:
    the trainer sends once, every server commits the same weights, whole and as a delta."""
    servers, as_client = tls_fleet
    client = InferenceClient(servers[0], servers, tls=as_client)
    for seed, version in ((41, 1), (42, 2)):
        result = await client.update_weights(perturbed(original, seed=seed).items(), version)
        assert result.relayed
        assert result.bytes_sent <= 1.05 * max(result.bytes_received.values())
    sums = await client.weight_checksums()
    assert sums[servers[0]] == sums[servers[1]] == sums[servers[2]] and sums[servers[0]]
    direct = InferenceClient(servers[0], servers[:1], tls=as_client)
    await direct.update_weights(perturbed(original, seed=42).items(), 3, delta=False)
    assert (await direct.weight_checksums())[servers[0]] == sums[servers[0]]
    await direct.close()
    await client.close()
