"""The HTTP edge's own logic against stand-in backends: translation, sessions on the router's
placement, error statuses, cancellation on disconnect. (The subject is the edge and the
router, not vLLM: tests/edge/test_http_edge.py runs the real SDK against real engines.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from servers.router.http_edge import parse
from servers.router.http_edge.http_status import error_body
from servers.router.proxy import ProxyOptions
from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
from skyrl_grpc.names import GENERATE_STREAM
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import until

# A router (with its HTTP edge) over three stand-in backends, and the backends.
EdgeOnStandIns = tuple[RouterServer, list[FakeBackend]]


@pytest.fixture
async def edge_on_stand_ins() -> AsyncIterator[EdgeOnStandIns]:
    backends = [await FakeBackend(f"fake{i}", delay=0.01).start() for i in range(3)]
    router = RouterServer(
        RouterOptions(
            backends=[b.address for b in backends], health_check_interval=0.1, http_port=0
        )
    )
    await router.start()
    await router.wait_healthy(3)
    yield router, backends
    await router.stop(0)
    for backend in backends:
        await backend.stop()


def http(router: RouterServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=30)


def test_openai_fields_become_sampling_params_and_bad_ones_name_themselves() -> None:
    call = parse.read_generation(
        {
            "model": "m",
            "prompt": [[1, 2], "text"],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "min_p": 0.1,
            "seed": 7,
            "stop": "x",
            "stop_token_ids": [9],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": 2,
            "n": 2,
            "user": "someone",
        },
        chat=False,
    )
    p = call.sampling
    assert call.prompts == [[1, 2], "text"] and call.n == 2
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.logprobs) == (5, 0.0, 3, 7, 2)
    assert abs(p.top_p - 0.5) < 1e-6 and list(p.stop_strings) == ["x"]
    assert list(p.stop_token_ids) == [9] and p.ignore_eos and not p.skip_special_tokens
    chat = parse.read_generation(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
        },
        chat=True,
    )
    assert chat.messages[0].content == "hi" and chat.sampling.max_tokens == 4
    assert chat.sampling.logprobs == 3
    assert parse.read_generation({"prompt": "x"}, chat=False).sampling.max_tokens == 16
    assert not parse.read_generation({"messages": [{"role": "user"}]}, True).sampling.HasField(
        "max_tokens"
    )
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "n": 0}, "'n' = 0"),
        ({"messages": [{"role": "user", "content": "x"}], "n": -2}, "'n' = -2"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"messages": []}, "messages"),
    ]
    for body, named in cases:
        with pytest.raises(InvalidArgument, match=named):
            parse.read_generation(body, chat="messages" in body)


def test_grpc_statuses_map_to_http_statuses_in_openai_error_bodies() -> None:
    for code, status in [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ]:
        got, body = error_body(code, "why")
        assert got == status and body["error"]["message"] == "why"
        assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_streamed_completion_is_server_sent_events_ending_in_done(
    edge_on_stand_ins: EdgeOnStandIns,
) -> None:
    router, _ = edge_on_stand_ins
    async with http(router) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert tokens == [0, 1, 2, 3]  # the stand-in generates token i at step i
    finishes = [c["finish_reason"] for e in events for c in e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert events[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]


async def test_a_session_lands_where_its_grpc_calls_land(edge_on_stand_ins: EdgeOnStandIns) -> None:
    router, backends = edge_on_stand_ins
    async with http(router) as client, grpc.aio.insecure_channel(router.address) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)
        for i in range(6):
            session = f"agent-{i}"
            call = stub.GenerateStream(
                data_plane_pb2.GenerateStreamRequest(prompt_token_ids=[1]),
                metadata=((SESSION_ID, session),),
            )
            grpc_home = str(dict(await call.initial_metadata())[ROUTED_TO])
            async for _ in call:
                pass
            by_address = {b.address: b for b in backends}
            before = by_address[grpc_home].observed.calls
            headers = {"X-Session-ID": session} if i % 2 else {}
            body = {"prompt": [1], "max_tokens": 2}
            if not i % 2:
                body["session_id"] = session  # harnesses that cannot set headers
            response = await client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            assert by_address[grpc_home].observed.calls > before
            sent = by_address[grpc_home].observed.metadata[-1]
            assert sent[SESSION_ID] == session  # the body field became the header


async def test_backend_errors_keep_their_status_and_a_disconnect_cancels_upstream(
    edge_on_stand_ins: EdgeOnStandIns,
) -> None:
    router, backends = edge_on_stand_ins
    async with http(router) as client:
        for backend in backends:
            backend.servicer.fail_next_with = grpc.StatusCode.INVALID_ARGUMENT
        response = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "told to fail" in error["message"]
        for backend in backends:
            backend.servicer.fail_next_with = None
        response = await client.post("/v1/completions", json={"prompt": [1], "model": "other"})
        assert response.status_code == 404 and "other" in response.json()["error"]["message"]
        bad = await client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        long = {"prompt": [1], "max_tokens": 100_000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the first token arrived: hang up
    await until(
        lambda: sum(b.observed.cancelled for b in backends) == 1,
        what="the hang-up to cancel the stream at its backend",
    )
    assert sum(b.observed.in_flight for b in backends) == 0


async def test_health_and_finish_session(edge_on_stand_ins: EdgeOnStandIns) -> None:
    router, backends = edge_on_stand_ins
    async with http(router) as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.post("/finish_session", json={"session_id": "s1"})
        assert response.json() == {"session_id": "s1", "found": True}
        assert all(b.observed.finished_sessions == ["s1"] for b in backends)
        missing = await client.post("/finish_session", json={})
        assert missing.status_code == 400
        assert (await client.get("/v1/nothing")).status_code == 404
        for backend in backends:
            await backend.set_serving(False)
        await until(lambda: not router.pool.healthy(), what="the router to see none serving")
        response = await client.get("/health")
        assert response.status_code == 503
        router.proxy.options.hold_seconds = 0.2  # a call waits that long for one to serve
        try:
            failed = await client.post("/v1/completions", json={"prompt": [1]})
        finally:
            router.proxy.options.hold_seconds = ProxyOptions().hold_seconds
        message = failed.json()["error"]["message"]
        assert failed.status_code == 503 and "no healthy backend" in message, message
        assert "held the call 0.2 s" in message
        # Held until one serves again: answered whole.
        held = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [1]}))
        await until(lambda: router.proxy.holding == 1, what="the completion held")
        await backends[0].set_serving(True)
        answered = await held
        assert answered.status_code == 200, answered.text
        for backend in backends:
            await backend.set_serving(True)
        await router.wait_healthy(len(backends))


async def test_retry_before_the_first_token_and_migration_mid_stream_hold_over_http(
    edge_on_stand_ins: EdgeOnStandIns,
) -> None:
    router, backends = edge_on_stand_ins
    async with http(router) as client:
        for backend in backends:  # whichever is picked first fails before any token
            backend.servicer.fail_next_with = grpc.StatusCode.UNAVAILABLE
        backends[-1].servicer.fail_next_with = None
        response = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
        for backend in backends:
            backend.servicer.fail_next_with = None
        # Every backend dies after 2 tokens of a stream: the router moves the stream on with
        # the tokens so far, and the HTTP client sees one stream of all 6 tokens.
        for backend in backends:
            backend.servicer.fail_after_tokens = 2
        body = {"prompt": [1], "max_tokens": 6, "stream": True, "return_token_ids": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        events = [json.loads(line[6:]) for line in lines]
        tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        assert len(tokens) == 6 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert (
            router.metrics.registry.get_sample_value(
                "skyrl_router_migrations_total", {"method": GENERATE_STREAM}
            )
            or 0
        ) >= 1


async def test_a_router_told_its_servers_capture_routed_experts_returns_them_as_vllm_does() -> None:
    """With ``--routed-experts`` the edge asks for every whole answer's routed experts and
    returns them in vLLM's field and encoding (base64 ``.npy``, decoded by vLLM's own rule);
    streamed answers do not ask (vLLM's streams carry none), and a router not told so asks
    for none and answers null, as vLLM's server without the flag does."""
    import base64
    import io

    import numpy as np

    # A 48-layer, 8-of-128 model's shape (Qwen3-30B-A3B), for 4 output tokens of a 2-token
    # prompt: the prompt's tokens and the outputs but the last.
    experts = np.random.default_rng(3).integers(0, 128, size=(5, 48, 8), dtype=np.uint8)
    backend = await FakeBackend("fake-moe", delay=0.001).start()
    backend.servicer.routed_experts = experts
    body = {"model": "fake-moe", "prompt": [1, 2], "max_tokens": 4}
    try:
        for told in (True, False):
            router = RouterServer(
                RouterOptions(
                    backends=[backend.address],
                    health_check_interval=0.1,
                    http_port=0,
                    routed_experts=told,
                )
            )
            await router.start()
            await router.wait_healthy(1)
            backend.servicer.asked_experts.clear()
            try:
                async with http(router) as client:
                    whole = (await client.post("/v1/completions", json=body)).json()
                    streamed = await client.post("/v1/completions", json={**body, "stream": True})
            finally:
                await router.stop(0)
            encoded = whole["choices"][0]["routed_experts"]
            if told:
                decoded = np.load(io.BytesIO(base64.b64decode(encoded)))
                assert decoded.dtype == np.uint8 and np.array_equal(decoded, experts)
                assert backend.servicer.asked_experts[:1] == [True]
                assert "routed_experts" not in streamed.text.replace('"routed_experts":null', "")
            else:
                assert encoded is None and not any(backend.servicer.asked_experts)
    finally:
        await backend.stop()
