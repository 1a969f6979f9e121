"""Security: bearer tokens on ControlPlane / DataPlane / RouterAdmin, and no pickle or eval on
any wire path."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from servers.engine import options as engine_options
from servers.engine.process import engine_server
from servers.engine.vllm_adapter.vllm_engine import VllmEngine
from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.metadata import bearer
from skyrl_grpc.names import CONTROL_PLANE_SERVICE, PUSH_WEIGHTS, method_path
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import (
    control_plane_pb2_grpc,
    data_plane_pb2,
    data_plane_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from skyrl_grpc.vllm_api import control_pb2 as vc
from skyrl_grpc.vllm_api import control_pb2_grpc, inference_pb2_grpc
from skyrl_grpc.vllm_api import inference_pb2 as vi
from tests.helpers.fake_backend import FakeBackend
from trainer_client import FanOutError, InferenceClient, ServerError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def guarded_server(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[engine_server.EngineServer]:
    # The subject is the auth layer in front of the servicers: the engine never needs to start
    # (calls that pass auth meet UNAVAILABLE "starting", which proves they got through).
    async def never_ready(*_: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(VllmEngine, "start", never_ready)
    server = engine_server.EngineServer(
        engine_options.ServerOptions(control_token="control-s3cret", data_token="data-s3cret")
    )
    await server.start()
    yield server
    await server.drain(grace=0)


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_tokens_guard_control_and_data_planes(
    guarded_server: engine_server.EngineServer,
) -> None:
    async with grpc.aio.insecure_channel(guarded_server.address) as channel:
        control = control_plane_pb2_grpc.ControlPlaneStub(channel)
        data = data_plane_pb2_grpc.DataPlaneStub(channel)
        pause = cp.PauseRequest(mode=cp.PAUSE_MODE_ABORT)
        assert await code_of(control.Pause(pause)) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await code_of(control.Pause(pause, metadata=(bearer("wrong"),)))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            await code_of(control.Pause(pause, metadata=(bearer("data-s3cret"),)))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            await code_of(control.Pause(pause, metadata=(bearer("control-s3cret"),)))
            == grpc.StatusCode.UNAVAILABLE
        )
        info = data_plane_pb2.GetModelInfoRequest()
        assert await code_of(data.GetModelInfo(info)) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await code_of(data.GetModelInfo(info, metadata=(bearer("data-s3cret"),)))
            == grpc.StatusCode.UNAVAILABLE
        )
        stream = data.GenerateStream(data_plane_pb2.GenerateStreamRequest(prompt_token_ids=[1]))
        assert await code_of(stream.read()) == grpc.StatusCode.UNAUTHENTICATED
        # vLLM's own protocol generates too: the data plane's token guards it, its probe open.
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        generate = vllm_engine_pb2.GenerateRequest(
            request_id="r", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1])
        )
        assert await code_of(vllm.Generate(generate).read()) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await code_of(vllm.Generate(generate, metadata=(bearer("data-s3cret"),)).read())
            == grpc.StatusCode.UNAVAILABLE
        )
        probe = vllm_engine_pb2.HealthCheckRequest()
        assert await code_of(vllm.HealthCheck(probe)) == grpc.StatusCode.UNAVAILABLE
        # vLLM's Rust front end's services: its Control as the ControlPlane, its Inference as
        # the DataPlane.
        vllm_control = control_pb2_grpc.ControlStub(channel)
        vllm_pause = vc.PauseGenerationRequest(mode=vc.PAUSE_MODE_KEEP)
        for token, code in ((None, "UNAUTHENTICATED"), ("data-s3cret", "UNAUTHENTICATED"),
                            ("control-s3cret", "UNAVAILABLE")):  # fmt: skip
            metadata = () if token is None else (bearer(token),)
            called = vllm_control.PauseGeneration(vllm_pause, metadata=metadata)
            assert await code_of(called) == getattr(grpc.StatusCode, code)
        vllm_inference = inference_pb2_grpc.InferenceStub(channel)
        by_ids = vi.GenerateRequest(token_ids=vi.TokenIds(ids=[1]))
        for token, code in ((None, "UNAUTHENTICATED"), ("control-s3cret", "UNAUTHENTICATED"),
                            ("data-s3cret", "UNAVAILABLE")):  # fmt: skip
            metadata = () if token is None else (bearer(token),)
            generated = vllm_inference.Generate(by_ids, metadata=metadata)
            assert await code_of(generated) == getattr(grpc.StatusCode, code)
        # Probes and discovery stay open.
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async with grpc.aio.insecure_channel(guarded_server.address) as channel:
            await control_plane_pb2_grpc.ControlPlaneStub(channel).Pause(pause)
    assert "missing bearer token for skyrl.inference.v1.ControlPlane" in (
        raised.value.details() or ""
    )


@pytest.mark.slow  # 1.6 GB through loopback
async def test_an_upload_refused_for_its_token_is_told_so_not_a_broken_connection(
    guarded_server: engine_server.EngineServer,
) -> None:
    """Refused while its caller is still sending (100 MB of weights or of an adapter), the call
    ends UNAUTHENTICATED, not in grpc's INTERNAL "Internal error from Core" that a caller reads
    as a lost server (one such call in four did, before the refusal read what was sent)."""
    async with grpc.aio.insecure_channel(guarded_server.address) as channel:
        load_adapter = method_path(CONTROL_PLANE_SERVICE, "LoadLoraAdapter")
        for method in (PUSH_WEIGHTS, load_adapter) * 8:
            upload: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(method)
            chunks = iter([bytes(4_000_000)] * 25)
            call = upload(chunks, metadata=(bearer("wrong"),))
            assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED, method


async def test_client_sends_its_token(guarded_server: engine_server.EngineServer) -> None:
    address = guarded_server.address
    for token, expected in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("control-s3cret", grpc.StatusCode.UNAVAILABLE),
    ):
        client = InferenceClient(address, [address], token=token, control_timeout=5)
        with pytest.raises(FanOutError) as raised:
            await client.is_paused()
        assert raised.value.failures[address].code == expected


async def test_router_admin_token() -> None:
    backend = await FakeBackend("b").start()
    router = RouterServer(
        RouterOptions(
            backends=[backend.address], admin_token="admin-s3cret", health_check_interval=0.1
        )
    )
    await router.start()
    await router.wait_healthy(1)
    async with grpc.aio.insecure_channel(router.address) as channel:
        admin = router_pb2_grpc.RouterAdminStub(channel)
        request = router_pb2.ListBackendsRequest()
        assert await code_of(admin.ListBackends(request)) == grpc.StatusCode.UNAUTHENTICATED
        listed = await admin.ListBackends(request, metadata=(bearer("admin-s3cret"),))
        assert [b.address for b in listed.backends] == [backend.address]
        # The data plane through the router is not the admin service: it is forwarded as is.
        info = await data_plane_pb2_grpc.DataPlaneStub(channel).GetModelInfo(
            data_plane_pb2.GetModelInfoRequest()
        )
        assert info.served_model_name == "b"
    await router.stop(0)
    await backend.stop()


WIRE_PACKAGES = ("servers", "trainer_client", "skyrl_grpc")
FORBIDDEN = re.compile(
    r"\b(import pickle|from pickle|cloudpickle|pickle\.loads?|marshal\.loads|eval\(|exec\()"
)


def test_no_pickle_or_eval_on_any_wire_path() -> None:
    offenders = []
    scanned = 0
    for package in WIRE_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            scanned += 1
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if FORBIDDEN.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert scanned > 20
    assert not offenders, "\n".join(offenders)


async def test_a_client_takes_a_token_for_each_plane(
    guarded_server: engine_server.EngineServer,
) -> None:
    """Servers started with --control-token and --data-token apart: one client generates and
    pauses (a single ``token`` could only pass one of the two)."""
    address = guarded_server.address
    both = InferenceClient(
        address,
        [address],
        data_token="data-s3cret",
        control_token="control-s3cret",
        control_timeout=5,
        direct=False,
    )
    with pytest.raises(FanOutError) as raised:
        await both.is_paused()
    assert raised.value.failures[address].code == grpc.StatusCode.UNAVAILABLE  # past the token
    with pytest.raises(ServerError) as failed:
        await both.model_info(timeout=5)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE  # past the token: still starting
    one = InferenceClient(address, [address], token="control-s3cret", direct=False)
    with pytest.raises(ServerError) as refused:
        await one.model_info(timeout=5)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_the_skyrl_drop_in_sends_the_data_token_to_the_edge() -> None:
    """Its OpenAI calls carry the data plane's token, as its gRPC calls do."""
    from trainer_client.skyrl_engine import SkyRLInferenceEngine

    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        body = b'{"choices": []}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    edge = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = edge.sockets[0].getsockname()[1]
    engine = SkyRLInferenceEngine(
        "127.0.0.1:1",
        ["127.0.0.1:1"],
        http_url=f"http://127.0.0.1:{port}",
        data_token="data-s3cret",
        control_token="control-s3cret",
    )
    await engine.chat_completion({"json": {"messages": []}})
    await engine.client.close()
    edge.close()
    assert b"authorization: Bearer data-s3cret" in seen[0].lower().replace(b"bearer", b"Bearer")


async def test_an_over_size_message_is_refused_naming_max_message_mib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over --max-message-mib, the refusal names the flag: the server's own (up to twice the
    limit, which gRPC still reads), and gRPC's generic one beyond, as the client reports it."""
    from skyrl_grpc.channels import MiB
    from skyrl_grpc.errors import call_status

    async def never_ready(*_: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(VllmEngine, "start", never_ready)
    server = engine_server.EngineServer(engine_options.ServerOptions(max_message_bytes=MiB))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            server.address, options=[("grpc.max_send_message_length", 8 * MiB)]
        ) as channel:
            pause: Any = channel.unary_unary(method_path(CONTROL_PLANE_SERVICE, "Pause"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # within gRPC's headroom
                await pause(bytes(3 * MiB // 2))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-message-mib 1 allows" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # past it: gRPC's refusal
                await pause(bytes(3 * MiB))
            code, details = call_status(refused.value)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-message-mib" in details
    finally:
        await server.drain(grace=0)
