"""The router's logic over real sockets, with stand-in backends (the router is the subject)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers.router.backends import BackendPool
from servers.router.forwarding import ForwardingHandler
from servers.router.proxy import ProxyOptions
from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.errors import TRANSPORT_BROKE
from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc, router_pb2, router_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def start_router(backends: list[FakeBackend], **kw: object) -> RouterServer:
    # Ring placement: these tests follow sessions through ejection and re-admission, where a
    # ring owner takes its sessions back (bounded-load keeps them where they moved: see
    # test_bounded_load_sessions_stay_where_they_moved).
    kw.setdefault("placement", "consistent-hash")
    options = RouterOptions(backends=[b.address for b in backends], health_check_interval=0.1, **kw)  # type: ignore[arg-type]
    router = RouterServer(options)
    await router.start()
    await router.wait_healthy(len(backends))
    return router


def _owner(backends: list[FakeBackend], router: RouterServer, session: str) -> FakeBackend:
    """The stand-in the router places ``session`` on."""
    return next(b for b in backends if b.address == router.pool.owner(session))


# Four stand-in backends, a router over them, a channel to the router.
StandIns = tuple[list[FakeBackend], RouterServer, grpc.aio.Channel]


@pytest.fixture
async def router_on_stand_ins() -> AsyncIterator[StandIns]:
    backends = [await FakeBackend(f"b{i}").start() for i in range(4)]
    router = await start_router(backends, metrics_port=0)
    channel = grpc.aio.insecure_channel(router.address)
    yield backends, router, channel
    await channel.close()
    await router.stop(0)
    for b in backends:
        await b.stop()


def request(max_tokens: int = 4) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=[1, 2], sampling_params=gen.SamplingParams(max_tokens=max_tokens)
    )


async def routed_stream(
    channel: grpc.aio.Channel, session: str | None = None, max_tokens: int = 4, **kw: Any
) -> tuple[str, list[int]]:
    metadata = ((SESSION_ID, session),) if session else ()
    call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
        request(max_tokens), metadata=metadata, **kw
    )
    tokens = [t async for chunk in call for t in chunk.token_ids]
    backend = dict(await call.initial_metadata())[ROUTED_TO]
    return str(backend), tokens


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return response.status  # type: ignore[no-any-return]


async def test_streams_and_unary_are_forwarded_unchanged(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    address, tokens = await routed_stream(channel, max_tokens=5)
    assert tokens == [0, 1, 2, 3, 4]
    assert address in {b.address for b in backends}
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    call = stub.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=[1], sampling_params=gen.SamplingParams(max_tokens=3)
        )
    )
    response = await call
    assert list(response.samples[0].token_ids) == [0, 1, 2]
    assert dict(await call.initial_metadata())[ROUTED_TO] in {b.address for b in backends}


async def test_session_affinity_and_metadata_forwarding(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    by_address: dict[object, FakeBackend] = {b.address: b for b in backends}
    landed: dict[str, set[str]] = {}
    for _turn in range(3):
        for session in [f"conv-{i}" for i in range(20)]:
            address, _ = await routed_stream(channel, session)
            landed.setdefault(session, set()).add(address)
    assert all(len(addresses) == 1 for addresses in landed.values())
    assert len({a for s in landed.values() for a in s}) >= 3  # sessions spread over backends
    for session, (address,) in landed.items():
        assert router.pool.owner(session) == address
    # The backend sees the caller's metadata (session, auth, tracing) untouched.
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    metadata = (
        (SESSION_ID, "conv-0"),
        ("authorization", "Bearer t0k"),
        ("traceparent", "00-abc-def-01"),
    )
    call = stub.GetModelInfo(data_plane_pb2.GetModelInfoRequest(), metadata=metadata)
    await call
    seen = by_address[dict(await call.initial_metadata())[ROUTED_TO]].observed.metadata[-1]
    assert seen[SESSION_ID] == "conv-0" and seen["authorization"] == "Bearer t0k"
    assert seen["traceparent"] == "00-abc-def-01"


async def test_no_session_goes_to_least_loaded(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    for b in backends:
        b.servicer.delay = 0.05
    long_calls = [asyncio.ensure_future(routed_stream(channel, max_tokens=40)) for _ in range(3)]
    await until(lambda: sum(b.observed.in_flight for b in backends) == 3, what="3 calls running")
    busy = {b.address for b in backends if b.observed.in_flight}
    assert len(busy) == 3  # three long calls spread over three backends
    address, _ = await routed_stream(channel, max_tokens=1)
    assert address not in busy
    for call in long_calls:
        call.cancel()


async def test_unhealthy_backend_is_ejected_and_readmitted(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    sessions = [f"s{i}" for i in range(40)]
    before = {s: router.pool.owner(s) for s in sessions}
    victim = backends[1]
    await victim.set_serving(False)  # e.g. draining
    await until(
        lambda: victim.address not in {b.address for b in router.pool.healthy()},
        what="the not-serving backend ejected",
    )
    calls_before = victim.observed.calls
    for s in sessions:
        address, _ = await routed_stream(channel, s)
        assert address != victim.address
        if before[s] != victim.address:
            assert address == before[s]  # other sessions did not move
    assert victim.observed.calls == calls_before
    assert await health_status(channel) == SERVING
    await victim.set_serving(True)
    await router.wait_healthy(4, timeout=60)
    for s in sessions:
        assert (await routed_stream(channel, s))[0] == before[s]  # sessions came back


async def test_stopped_backend_is_ejected_and_restarted_one_rejoins(
    router_on_stand_ins: StandIns,
) -> None:
    backends, router, channel = router_on_stand_ins
    victim = backends[3]
    port = victim.port
    await victim.stop()
    await until(
        lambda: victim.address not in {b.address for b in router.pool.healthy()},
        what="the stopped backend to be ejected",
    )
    for i in range(30):
        assert (await routed_stream(channel, f"k{i}"))[0] != victim.address
    restarted = await FakeBackend("b3-again", port=port).start()
    await router.wait_healthy(4, timeout=60)
    owned = [s for s in (f"k{i}" for i in range(30)) if router.pool.owner(s) == restarted.address]
    assert owned
    for s in owned:
        assert (await routed_stream(channel, s))[0] == restarted.address
    await restarted.stop()


async def test_a_backend_back_is_routed_to_once_its_channel_reconnects_not_a_check_later() -> None:
    """A server healed from a partition (here: stopped, then listening again on its port) is
    watched again as soon as the router's channel reconnects, which it retries within about
    half the backend liveness: not after the health check interval (a minute here)."""
    backend = await FakeBackend("healed").start()
    port = backend.port
    options = RouterOptions(backends=[backend.address], health_check_interval=60.0)
    router = RouterServer(options)
    await router.start()
    try:
        await router.wait_healthy(1)
        await backend.stop()
        await until(lambda: not router.pool.healthy(), what="the stopped backend ejected")
        backend = await FakeBackend("healed-again", port=port).start()
        await router.wait_healthy(1, timeout=20)
    finally:
        await router.stop(0)
        await backend.stop()


async def test_no_healthy_backend_is_unavailable_with_reason(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    router.proxy.options.hold_seconds = 0.2  # held that long (below: held until one serves)
    for b in backends:
        await b.set_serving(False)
    await until(lambda: not router.pool.healthy(), what="every backend ejected")

    async def not_serving() -> bool:
        return bool(await health_status(channel) == NOT_SERVING)

    await until(not_serving, what="the router's health to turn NOT_SERVING")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await routed_stream(channel, "any")
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy backend" in (raised.value.details() or "")
    assert "held the call 0.2 s" in (raised.value.details() or "")
    # A deadline before the hold's end: answered UNAVAILABLE before it, saying why.
    router.proxy.options.hold_seconds = 30
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await routed_stream(channel, "any", timeout=3)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "held the call 2." in (raised.value.details() or "")  # to 0.5 s before it
    for b in backends:
        await b.set_serving(True)
    await router.wait_healthy(4, timeout=60)
    assert await health_status(channel) == SERVING


async def test_a_call_finding_no_backend_serving_is_held_until_one_serves_again(
    router_on_stand_ins: StandIns,
) -> None:
    """Every backend lost at once (a partition, the router's own link): a call waits for one
    to serve again (``--hold-seconds``) instead of failing, then goes there."""
    backends, router, channel = router_on_stand_ins
    for b in backends:
        await b.set_serving(False)
    await until(lambda: not router.pool.serving(), what="every backend ejected")
    call = asyncio.ensure_future(routed_stream(channel, "held"))
    await until(lambda: router.proxy.holding == 1, what="the call held")
    assert not call.done()
    await backends[2].set_serving(True)
    address, tokens = await call
    assert address == backends[2].address and tokens == [0, 1, 2, 3]
    assert router.proxy.holding == 0
    for b in backends:
        await b.set_serving(True)
    await router.wait_healthy(4, timeout=60)


async def test_a_stream_whose_only_backend_is_lost_waits_and_moves_when_one_serves() -> None:
    """The one backend a stream runs on is lost mid-stream with no other serving: the stream
    is held, then continues from its tokens so far once a backend serves again (here the same
    one, back): one uninterrupted stream, nothing repeated."""
    backend = await FakeBackend("only", delay=0.05).start()
    router = await start_router([backend])
    backend.servicer.fail_after_tokens = 2
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = data_plane_pb2_grpc.DataPlaneStub(channel)
            call = stub.GenerateStream(request(6), metadata=((SESSION_ID, "alone"),))
            chunks = call.__aiter__()
            tokens = list((await chunks.__anext__()).token_ids)
            await backend.set_serving(False)  # lost before its failure: no other serves
            await until(lambda: router.proxy.holding == 1, what="the stream held")
            backend.servicer.fail_after_tokens = None
            await backend.set_serving(True)
            tokens += [t async for chunk in chunks for t in chunk.token_ids]
        assert tokens == [0, 1, 0, 1, 2, 3]
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await router.stop(0)
        await backend.stop()


async def test_a_stream_moved_back_to_a_server_still_running_it_aborts_it_there_first() -> None:
    """A server cut off rather than dead still runs the request the router lost (it never
    saw the stream end): the continuation, with the caller's own request id, is refused
    ALREADY_EXISTS there. The router aborts the orphan on that server and sends the
    continuation again: one stream, nothing repeated, the id free again at the end."""
    backend = await FakeBackend("cut-off", delay=0.05).start()
    router = await start_router([backend])
    backend.servicer.fail_after_tokens = 2
    backend.servicer.orphan_on_failure = True
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = data_plane_pb2_grpc.DataPlaneStub(channel)
            asked = request(6)
            asked.request_id = "agent-7"
            call = stub.GenerateStream(asked, metadata=((SESSION_ID, "cut"),))
            chunks = call.__aiter__()
            tokens = list((await chunks.__anext__()).token_ids)
            await backend.set_serving(False)
            await until(lambda: router.proxy.holding == 1, what="the stream held")
            assert backend.servicer.running_ids == {"agent-7"}  # the orphan
            backend.servicer.fail_after_tokens = None
            await backend.set_serving(True)
            tokens += [t async for chunk in chunks for t in chunk.token_ids]
        assert tokens == [0, 1, 0, 1, 2, 3]
        assert backend.observed.aborted == ["agent-7"]
        assert backend.servicer.running_ids == set()
    finally:
        await router.stop(0)
        await backend.stop()


async def test_a_stream_lost_before_its_first_token_aborts_its_orphan_before_it_goes_again() -> (
    None
):
    """A stream whose server was lost before it answered is tried again, unchanged, with the
    caller's request id: where it comes back to that server (the only one), which was cut off
    rather than dead and still runs it, the router aborts the orphan there first."""
    backend = await FakeBackend("cut-off", delay=0.02).start()
    router = await start_router([backend])
    backend.servicer.fail_after_tokens = 0
    backend.servicer.orphan_on_failure = backend.servicer.fail_once = True
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            asked = request(4)
            asked.request_id = "agent-8"
            call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(asked)
            tokens = [t async for chunk in call for t in chunk.token_ids]
        assert tokens == [0, 1, 2, 3]
        assert backend.observed.aborted == ["agent-8"]
        assert backend.servicer.running_ids == set()
    finally:
        await router.stop(0)
        await backend.stop()


async def test_a_batch_moved_back_to_a_server_still_running_it_aborts_its_orphans_there() -> None:
    """As for a stream: a batch's requests lost from a server cut off rather than dead still
    run there, and it refuses their continuations ALREADY_EXISTS; the router aborts each
    orphan and sends the request again. Each request reads one uninterrupted answer, and no
    error reaches the caller."""
    backend = await FakeBackend("cut-off", delay=0.05).start()
    router = await start_router([backend])
    backend.servicer.fail_after_tokens = 2
    backend.servicer.orphan_on_failure = True
    batch = data_plane_pb2.GenerateBatchRequest(
        requests=[request(6), request(6)], session_ids=["s-0", "s-1"]
    )
    batch.requests[0].request_id, batch.requests[1].request_id = "agent-0", "agent-1"
    tokens: dict[int, list[int]] = {0: [], 1: []}
    errors: list[str] = []
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateBatch(batch)
            messages = call.__aiter__()
            while sum(map(len, tokens.values())) < 4:  # two tokens of each before the loss
                message = await messages.__anext__()
                for chunk in message.chunks:
                    tokens[chunk.batch_index] += chunk.token_ids
                errors += [e.message for e in message.errors]
            await backend.set_serving(False)
            await until(lambda: router.proxy.holding == 1, what="the batch held")
            assert backend.servicer.running_ids == {"agent-0", "agent-1"}  # the orphans
            backend.servicer.fail_after_tokens = None
            await backend.set_serving(True)
            async for message in messages:
                for chunk in message.chunks:
                    tokens[chunk.batch_index] += chunk.token_ids
                errors += [e.message for e in message.errors]
        assert errors == []
        assert tokens == {0: [0, 1, 0, 1, 2, 3], 1: [0, 1, 0, 1, 2, 3]}
        assert sorted(backend.observed.aborted) == ["agent-0", "agent-1"]
        assert backend.servicer.running_ids == set()
    finally:
        await router.stop(0)
        await backend.stop()


async def test_retry_before_first_chunk_but_never_after(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    first_choice = router.pool.owner("retry-me")
    by_address: dict[object, FakeBackend] = {b.address: b for b in backends}
    by_address[first_choice].servicer.fail_next_with = grpc.StatusCode.UNAVAILABLE
    address, tokens = await routed_stream(channel, "retry-me")
    assert address != first_choice and tokens == [0, 1, 2, 3]
    await router.wait_healthy(4, timeout=60)  # the watch re-admits the backend that is fine
    # INVALID_ARGUMENT is the request's fault: passed through, not retried.
    owner = by_address[router.pool.owner("bad")]
    owner.servicer.fail_next_with = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await routed_stream(channel, "bad")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # After the first chunk, a lost backend is not retried (that would duplicate tokens): the
    # stream migrates, continuing from the tokens already sent.
    owner = by_address[router.pool.owner("mid")]
    owner.servicer.fail_after_tokens = 2
    calls = sum(b.observed.calls for b in backends)
    address, tokens = await routed_stream(channel, "mid", max_tokens=6)
    assert address == owner.address  # the header names the first backend
    # The stand-in restarts its count for the continuation: 2 tokens, then the remaining 4.
    assert tokens == [0, 1, 0, 1, 2, 3]
    assert sum(b.observed.calls for b in backends) == calls + 2
    owner.servicer.fail_after_tokens = None


async def test_a_connection_broken_mid_stream_migrates_a_server_error_does_not(
    router_on_stand_ins: StandIns,
) -> None:
    # When a backend's process dies between messages, grpc's client core may end the call with
    # INTERNAL "Internal error from Core" (its batch failed) instead of UNAVAILABLE; it is a
    # lost backend all the same (seen in CI: the killed-backend test failed with it).
    backends, router, channel = router_on_stand_ins
    owner = _owner(backends, router, "broken")
    owner.servicer.fail_after_tokens = 2
    owner.servicer.fail_mid_stream_with = (grpc.StatusCode.INTERNAL, TRANSPORT_BROKE)
    try:
        address, tokens = await routed_stream(channel, "broken", max_tokens=6)
        assert address == owner.address and tokens == [0, 1, 0, 1, 2, 3]  # migrated
        await router.wait_healthy(4, timeout=60)
        # A server's own INTERNAL is an answer, not a lost connection: passed through.
        owner = _owner(backends, router, "failing")
        owner.servicer.fail_after_tokens = 2
        owner.servicer.fail_mid_stream_with = (grpc.StatusCode.INTERNAL, "a bug in the server")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await routed_stream(channel, "failing", max_tokens=6)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert raised.value.details() == "a bug in the server"
    finally:
        for b in backends:
            b.servicer.fail_after_tokens = None
            b.servicer.fail_mid_stream_with = None


async def test_lost_backend_without_migration_is_unavailable_naming_it() -> None:
    backends = [await FakeBackend(f"b{i}").start() for i in range(2)]
    router = RouterServer(
        RouterOptions(
            backends=[b.address for b in backends],
            health_check_interval=0.1,
            proxy=ProxyOptions(max_migrations=0),
        )
    )
    await router.start()
    await router.wait_healthy(2)
    owner = {b.address: b for b in backends}[str(router.pool.owner("m"))]
    owner.servicer.fail_after_tokens = 2
    async with grpc.aio.insecure_channel(router.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await routed_stream(channel, "m", max_tokens=6)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"backend {owner.address} was lost mid-stream" in (raised.value.details() or "")
    assert "migration is off" in (raised.value.details() or "")
    await router.stop(0)
    for b in backends:
        await b.stop()


async def test_cancel_and_deadline_pass_through(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    for b in backends:
        b.servicer.delay = 0.05
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)
    call = stub.GenerateStream(request(200), metadata=((SESSION_ID, "c"),))
    await call.read()
    owner = _owner(backends, router, "c")
    call.cancel()
    await until(lambda: owner.observed.cancelled > 0, what="the upstream call's cancellation")
    assert owner.observed.in_flight == 0
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await routed_stream(channel, "d", max_tokens=200, timeout=0.4)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    owner = _owner(backends, router, "d")
    # Propagated (not the default of none); timer granularity allows a hair over the 0.4 s.
    assert owner.observed.deadlines[-1] is not None and owner.observed.deadlines[-1] <= 0.45
    await until(lambda: owner.observed.in_flight == 0, what="the upstream call to end")


async def test_admin_lists_adds_removes_and_drains(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    admin = router_pb2_grpc.RouterAdminStub(channel)
    listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
    assert sorted(b.address for b in listed.backends) == sorted(b.address for b in backends)
    assert all(b.state == router_pb2.BACKEND_STATE_HEALTHY for b in listed.backends)
    extra = await FakeBackend("extra").start()
    await admin.AddBackend(router_pb2.AddBackendRequest(address=extra.address))
    await router.wait_healthy(5, timeout=60)
    for code, call in [
        (
            grpc.StatusCode.ALREADY_EXISTS,
            admin.AddBackend(router_pb2.AddBackendRequest(address=extra.address)),
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            admin.AddBackend(router_pb2.AddBackendRequest(address="nope")),
        ),
        (
            grpc.StatusCode.NOT_FOUND,
            admin.RemoveBackend(router_pb2.RemoveBackendRequest(address="1.2.3.4:5")),
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await cast(Awaitable[object], call)
        assert raised.value.code() == code
    # Drain waits for the in-flight stream, which completes.
    extra.servicer.delay = 0.02
    owned = next(s for s in (f"z{i}" for i in range(200)) if router.pool.owner(s) == extra.address)
    stream = asyncio.ensure_future(routed_stream(channel, owned, max_tokens=30))
    await until(lambda: extra.observed.in_flight == 1, what="the stream to reach the backend")
    drained = await admin.DrainBackend(router_pb2.DrainBackendRequest(address=extra.address))
    assert drained.remaining_in_flight == 0
    address, tokens = await stream
    assert address == extra.address and len(tokens) == 30
    assert router.pool.owner(owned) != extra.address
    await admin.RemoveBackend(router_pb2.RemoveBackendRequest(address=backends[0].address))
    listed = await admin.ListBackends(router_pb2.ListBackendsRequest())
    assert len(listed.backends) == 3
    await extra.stop()


async def test_metrics_endpoint(router_on_stand_ins: StandIns) -> None:
    backends, router, channel = router_on_stand_ins
    await routed_stream(channel, "m")
    body = await asyncio.to_thread(
        lambda: (
            urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics")
            .read()
            .decode()
        )
    )
    for name in (
        "skyrl_router_processed_requests_total",
        "skyrl_router_request_duration_seconds_bucket",
        "skyrl_router_running_requests",
        "skyrl_router_worker_health",
        "skyrl_router_request_errors_total",
        "skyrl_router_ttft_seconds_bucket",
        "skyrl_router_policy_decisions_total",
    ):
        assert name in body
    assert f'skyrl_router_worker_health{{worker="{backends[0].address}"}} 1.0' in body


async def test_methods_unknown_to_the_router_are_relayed_as_raw_streams(
    router_on_stand_ins: StandIns,
) -> None:
    backends, router, channel = router_on_stand_ins
    # A router built from an older contract knows none of the methods: all are relayed raw.
    handler = ForwardingHandler(router.proxy)
    handler._streaming.clear()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as old_router:
        _, tokens = await routed_stream(old_router, "u", max_tokens=3)
        assert tokens == [0, 1, 2]
        info = await data_plane_pb2_grpc.DataPlaneStub(old_router).GetModelInfo(
            data_plane_pb2.GetModelInfoRequest()
        )
        assert info.served_model_name.startswith("b")
    await server.stop(0)


@pytest.mark.slow  # starts backend processes
def test_killed_backend_process_is_ejected_router_stays_serving() -> None:
    async def scenario() -> None:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.helpers.fake_backend",
                    "--name",
                    f"p{i}",
                    "--delay",
                    "0.01",
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        try:
            addresses = [json.loads(p.stdout.readline())["address"] for p in procs]  # type: ignore[union-attr]
            router = RouterServer(RouterOptions(backends=addresses, health_check_interval=0.2))
            await router.start()
            await router.wait_healthy(3)
            async with grpc.aio.insecure_channel(router.address) as channel:
                victim = addresses[0]
                victim_sessions = [
                    s for s in (f"v{i}" for i in range(100)) if router.pool.owner(s) == victim
                ]
                call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
                    request(500), metadata=((SESSION_ID, victim_sessions[0]),), timeout=60
                )
                first = await call.read()  # the stream runs on the victim
                assert isinstance(first, data_plane_pb2.GenerateStreamResponse)
                assert dict(await call.initial_metadata())[ROUTED_TO] == victim
                os.kill(procs[0].pid, signal.SIGKILL)
                killed = time.monotonic()
                # Migrated to a live backend, so it completes.
                streamed = list(first.token_ids)
                while isinstance(chunk := await call.read(), data_plane_pb2.GenerateStreamResponse):
                    streamed.extend(chunk.token_ids)
                assert chunk is grpc.aio.EOF and len(streamed) == 500
                while victim in {b.address for b in router.pool.healthy()}:
                    # Ejected on the broken watch: no call goes to it after the migration, so
                    # nothing else would eject it (bound generous for a loaded box).
                    assert time.monotonic() - killed < 30.0, "not ejected promptly"
                    await asyncio.sleep(0.01)
                sent_after_ejection = router.pool.get(victim).total_requests
                for s in victim_sessions + [f"n{i}" for i in range(20)]:
                    address, tokens = await routed_stream(channel, s, timeout=30)
                    assert address != victim and tokens == [0, 1, 2, 3]
                assert router.pool.get(victim).total_requests == sent_after_ejection
                assert await health_status(channel) == SERVING
            await router.stop(0)
        finally:
            for p in procs:
                p.kill()
                p.wait()

    asyncio.run(scenario())


async def test_bounded_load_sessions_stay_where_they_moved() -> None:
    backends = [await FakeBackend(f"b{i}").start() for i in range(3)]
    router = await start_router(backends, placement="bounded-load")
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            homes = {f"s{i}": (await routed_stream(channel, f"s{i}"))[0] for i in range(30)}
            assert sorted(Counter(homes.values()).values()) == [10, 10, 10]  # least loaded
            victim = backends[0]
            await victim.set_serving(False)
            await until(lambda: victim.address not in {b.address for b in router.pool.healthy()})
            moved = {s: (await routed_stream(channel, s))[0] for s in homes}
            for session, home in homes.items():
                assert moved[session] == home if home != victim.address else moved[session] != home
            # The server each moved session left is told it ended there.
            left = sorted(s for s in homes if homes[s] == victim.address)
            await until(lambda: sorted(victim.servicer.observed.finished_sessions) == left)
            await victim.set_serving(True)
            await router.wait_healthy(3, timeout=60)
            # Back in: moved sessions stay where their cache now is, except the excess of the
            # two overfull servers (15 each; the bound is floor(1.25 * 10) = 12)...
            back = {s: (await routed_stream(channel, s))[0] for s in homes}
            rebalanced = [s for s in homes if back[s] != moved[s]]
            assert len(rebalanced) == 6 and {back[s] for s in rebalanced} == {victim.address}
            # ...and the idle server takes the new sessions first.
            fresh = [(await routed_stream(channel, f"new{i}"))[0] for i in range(5)]
            assert fresh == [victim.address] * 5
    finally:
        await router.stop(0)
        for b in backends:
            await b.stop()


async def test_removing_a_backend_just_marked_unavailable_returns() -> None:
    # mark_unavailable cancels the health watch's call to ask for a recheck; a remove() that
    # comes before the watch task ran must still end that task, not be swallowed by it.
    backend = await FakeBackend("marked").start()
    pool = BackendPool([backend.address], check_interval=0.05)
    try:
        await pool.start()
        member = pool.get(backend.address)
        await until(
            lambda: member.eligible and member.watch_call is not None,
            what="the health watch in its call, the backend read healthy",
        )
        pool.mark_unavailable(member)
        # A remove swallowed by the recheck would wait on a healthy backend's watch forever.
        await asyncio.wait_for(pool.remove(backend.address), timeout=60)
        assert member.watch_task is not None and member.watch_task.done()
    finally:
        await pool.close()
        await backend.stop()
