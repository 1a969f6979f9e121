"""Router replicas on real engines over real sockets: two router processes behind one gRPC and
one HTTP address (``route --replicas 2``), agreeing on every session's server with no state of
their own shared; a membership change told to one reaches the other; a replica killed under
load leaves new connections to the other at once and is back within 5 s."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest

from servers.engine.options import TINY_MODEL_NAME
from servers.router.replicas import REPLICA_RESTARTS
from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.v1 import data_plane_pb2_grpc, router_pb2, router_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.server_process import ServerProcess
from tests.helpers.streams import stream_request
from tests.helpers.waits import until

pytestmark = [pytest.mark.engine]

ONE_TOKEN = gen.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
SESSIONS = 1000
# Turns in flight at once (each on a connection of its own).
CONCURRENCY = 32
# A channel with a connection of its own, not one shared with the process's other channels.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Replicas:
    """``python -m servers.router --replicas 2`` in front of the two shared engine servers."""

    def __init__(self, backends: list[str], log: Path) -> None:
        self.log = log  # the supervisor's and replicas' logs
        self.process = ServerProcess(
            "--replicas", "2",
            "--backends", ",".join(backends),
            "--http-port", "0",
            "--metrics-port", "0",
            "--health-check-interval", "0.2",
            command=("-m", "servers.router"),
            stderr=log,
        )  # fmt: skip
        self.address = self.process.address
        listening = next(e for _, e in self.process.events if e["event"] == "listening")
        self.http = f"http://127.0.0.1:{listening['http_port']}"
        self.metrics_ports: list[int] = listening["metrics_ports"]

    def pids(self) -> list[int]:
        """The replicas' processes (the supervisor's children)."""
        return sorted(p.pid for p in psutil.Process(self.process.proc.pid).children())

    def requests_per_replica(self) -> list[float]:
        """Calls each replica forwarded so far (its /metrics; blocking: call in a thread)."""
        counts = []
        for port in self.metrics_ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            counts.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.decode().splitlines()
                    if line.startswith("skyrl_router_processed_requests_total{")
                )
            )
        return counts


@pytest.fixture(scope="module")
async def replicas(
    engine_server: Any, second_engine_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Replicas]:
    # The engine servers run on this test process's loop: nothing here may block it.
    backends = [engine_server.address, second_engine_server.address]
    log = tmp_path_factory.mktemp("replicas") / "router.log"
    started = await asyncio.to_thread(Replicas, backends, log)
    try:
        await until(lambda: all_see(started.address, 2), 60, "both backends healthy", 0.1)
        yield started
    finally:
        started.process.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(started.process.proc.wait, 30)


async def healthy_backends(address: str) -> int:
    """Backends the replica a new connection reaches sees healthy."""
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
        try:
            listed = await router_pb2_grpc.RouterAdminStub(channel).ListBackends(
                router_pb2.ListBackendsRequest(), timeout=5
            )
        except grpc.aio.AioRpcError:
            return 0
    return sum(b.state == router_pb2.BACKEND_STATE_HEALTHY for b in listed.backends)


async def all_see(address: str, count: int, connections: int = 8) -> bool:
    """Whether ``connections`` new connections (spread over the replicas) all see ``count``
    healthy backends."""
    seen = [await healthy_backends(address) for _ in range(connections)]
    return all(n == count for n in seen)


async def turn(address: str, session: str, prompt: list[int]) -> str:
    """One turn of ``session`` on a connection of its own (channels of one process otherwise
    share connections); the server it reached."""
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
        call = data_plane_pb2_grpc.DataPlaneStub(channel).GenerateStream(
            stream_request(prompt, ONE_TOKEN), metadata=((SESSION_ID, session),), timeout=60
        )
        async for _ in call:
            pass
        return str(dict(await call.initial_metadata())[ROUTED_TO])


async def bounded(calls: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Any) -> Any:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def test_every_second_turn_reaches_its_first_turns_server_through_any_replica(
    replicas: Replicas,
) -> None:
    """1000 sessions of two turns, each turn on a new connection (so on either replica, as
    the kernel spreads them): every second turn reaches the server the first one did, both
    replicas forwarded turns, and placement stays bounded (max/mean <= 1.25)."""
    before = await asyncio.to_thread(replicas.requests_per_replica)
    sessions = [f"replicated-{i}" for i in range(SESSIONS)]
    first = await bounded(
        [turn(replicas.address, s, [1, 5, i % 50 + 7]) for i, s in enumerate(sessions)]
    )
    second = await bounded(
        [turn(replicas.address, s, [1, 5, i % 50 + 7, 9]) for i, s in enumerate(sessions)]
    )
    moved = [s for s, a, b in zip(sessions, first, second, strict=True) if a != b]
    assert not moved, f"{len(moved)} second turns went elsewhere, e.g. {moved[:3]}"
    after = await asyncio.to_thread(replicas.requests_per_replica)
    per_replica = [a - b for a, b in zip(after, before, strict=True)]
    assert all(count >= SESSIONS / 4 for count in per_replica), per_replica
    placed = Counter(first)
    mean = SESSIONS / len(placed)
    assert len(placed) == 2 and max(placed.values()) / mean <= 1.25, placed


async def test_the_same_through_the_http_edge_with_x_session_id(replicas: Replicas) -> None:
    """The same over the OpenAI edge, each turn a new HTTP connection with X-Session-ID: the
    servers between them hold each session once (a second turn elsewhere would hold it
    twice)."""
    sessions = [f"edge-{i}" for i in range(SESSIONS)]

    async def http_turn(session: str, prompt: str) -> None:
        async with httpx.AsyncClient(base_url=replicas.http, timeout=60) as client:
            answer = await client.post(
                "/v1/completions",
                headers={"X-Session-ID": session},
                json={
                    "model": TINY_MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0,
                },
            )
            assert answer.status_code == 200, answer.text

    for round_ in ("a b", "a b c"):
        await bounded([http_turn(s, f"{s} {round_}") for s in sessions])
    with grpc.insecure_channel(replicas.address) as channel:
        backends = router_pb2_grpc.RouterAdminStub(channel).ListBackends(
            router_pb2.ListBackendsRequest(), timeout=10
        )
    edge_sessions = await sessions_held([b.address for b in backends.backends], "edge-")
    assert sum(edge_sessions.values()) == SESSIONS, edge_sessions
    mean = SESSIONS / len(edge_sessions)
    assert max(edge_sessions.values()) / mean <= 1.25, edge_sessions


async def sessions_held(servers: list[str], prefix: str) -> Counter[str]:
    """How many sessions named ``prefix...`` each server reports holding (its ServerStatus
    stream's first message lists every live session)."""
    from skyrl_grpc.v1 import status_pb2, status_pb2_grpc

    held: Counter[str] = Counter()
    for address in servers:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = status_pb2_grpc.ServerStatusStub(channel).Watch(
                status_pb2.WatchRequest(), timeout=10
            )
            first = await stream.read()
            stream.cancel()
            assert isinstance(first, status_pb2.WatchResponse)
            held[address] = sum(1 for s in first.sessions_added if s.startswith(prefix))
    return held


async def test_a_membership_change_told_to_one_replica_reaches_the_other(
    replicas: Replicas, engine_server: Any
) -> None:
    """Removed through the shared address (one replica), a backend is gone from both; added
    back, both route to it again."""
    address = engine_server.address
    async with grpc.aio.insecure_channel(replicas.address) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        await admin.RemoveBackend(router_pb2.RemoveBackendRequest(address=address))
    try:
        # Every connection, whichever replica it reaches, sees it gone.
        assert await all_see(replicas.address, 1, connections=16)
    finally:
        async with grpc.aio.insecure_channel(replicas.address) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            await admin.AddBackend(router_pb2.AddBackendRequest(address=address))
    await until(
        lambda: all_see(replicas.address, 2, connections=16),
        30,
        "both replicas to route to both servers again",
        0.1,
    )


async def test_a_replica_killed_under_load_is_replaced_and_new_calls_go_on(
    replicas: Replicas,
) -> None:
    """kill -9 of one replica while sessions run through both: calls on new connections keep
    succeeding at once (the kernel sends them to the replica left), the OpenAI SDK's streams
    the dead replica held end with an error rather than hang, the trainer client's calls on the
    shared address all succeed, and the replica is back at the supervisor's first try."""
    import openai

    from trainer_client import InferenceClient

    victim, survivor = replicas.pids()
    stop = asyncio.Event()
    outcomes: Counter[str] = Counter()
    trainer = InferenceClient(replicas.address, direct=False)
    sdk = openai.AsyncOpenAI(base_url=f"{replicas.http}/v1", api_key="none")

    async def trainer_traffic() -> None:
        while not stop.is_set():
            result = await asyncio.wait_for(
                trainer.generate([1, 3, 4], {"max_tokens": 4, "ignore_eos": True}), 60
            )
            assert len(result.token_ids) == 4
            outcomes["trainer ok"] += 1

    async def sdk_traffic() -> None:
        while not stop.is_set():
            try:
                stream = await sdk.completions.create(
                    model=TINY_MODEL_NAME, prompt="a b c", max_tokens=32, stream=True
                )
                async for _ in stream:
                    pass
                outcomes["sdk ok"] += 1
            except openai.APIError:
                outcomes["sdk ended with an error"] += 1

    async def traffic(worker: int) -> None:
        index = 0
        while not stop.is_set():
            index += 1
            try:
                await asyncio.wait_for(
                    turn(replicas.address, f"load-{worker}-{index}", [1, 3, 4]), 30
                )
                outcomes["ok"] += 1
            except (grpc.aio.AioRpcError, OSError):
                outcomes["failed"] += 1

    workers = [asyncio.ensure_future(traffic(w)) for w in range(6)]
    workers += [asyncio.ensure_future(trainer_traffic()), asyncio.ensure_future(sdk_traffic())]
    workers += [asyncio.ensure_future(sdk_traffic())]
    await until(lambda: outcomes["ok"] >= 20, what="traffic through both replicas")
    logged = len(replicas.log.read_text().splitlines())  # what came before the kill
    os.kill(victim, signal.SIGKILL)
    killed, killed_at = time.monotonic(), time.time()
    ok_at_kill = outcomes["ok"]
    await until(lambda: outcomes["ok"] >= ok_at_kill + 20, what="calls going on after the kill")
    await until(
        lambda: len(replicas.pids()) == 2 and victim not in replicas.pids(),
        10,
        "the replica to be restarted",
    )
    restarted = next(p for p in replicas.pids() if p != survivor)
    # The supervisor starts it again at once (wall clock: the kill to the new process's birth).
    replaced_after = psutil.Process(restarted).create_time() - killed_at
    await until(
        lambda: any(
            c.laddr.port == int(replicas.address.rpartition(":")[2])
            for c in psutil.Process(restarted).net_connections()
            if c.status == psutil.CONN_LISTEN
        ),
        # Its start (Python, grpc, the router's imports) is the machine's: on an idle one it
        # listens within 5 s of the kill, on one busy with other engines it may take longer.
        60,
        "the restarted replica to listen",
    )
    back_after = time.monotonic() - killed
    stop.set()
    await asyncio.wait_for(asyncio.gather(*workers), 120)  # none hangs
    await trainer.close()
    # Replaced at its first try, after the supervisor's first delay (0.5 s, no backoff): read
    # from its own log, not timed here (a busy machine delays processes by seconds).
    after = replicas.log.read_text().splitlines()[logged:]
    died = [line for line in after if "died" in line]
    assert len(died) == 1 and "exit code -9" in died[0], died
    assert f"restarting in {REPLICA_RESTARTS.first_delay:.0f} s" in died[0], died
    print(f"replaced {replaced_after:.1f} s and listening {back_after:.1f} s after the kill")
    assert outcomes["trainer ok"] and outcomes["sdk ok"], outcomes
    # Only calls the dead replica held can have failed: far fewer than went on.
    assert outcomes["failed"] <= 8, outcomes
    await until(lambda: all_see(replicas.address, 2), 30, "the restarted replica to route to both")
