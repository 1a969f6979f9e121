"""TLS and mutual TLS on the engine server and the router, and the client's TLS channels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers.common.listener import ServerTls
from servers.engine import options as engine_options
from servers.engine.process import engine_server
from servers.engine.vllm_adapter.vllm_engine import VllmEngine
from servers.router.router_server import RouterOptions, RouterServer
from skyrl_grpc.tls import TlsConfig
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.helpers.certs import Certificates, make_certificates
from tests.helpers.fake_backend import FakeBackend
from tests.helpers.waits import ENGINE_START_SECONDS
from trainer_client import InferenceClient


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


async def liveness(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=30
    )
    return response.status  # type: ignore[no-any-return]


@pytest.fixture
async def tls_server(
    certs: Certificates, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[engine_server.EngineServer]:
    # The subject is the transport: the engine never needs to start.
    async def never_ready(*_: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(VllmEngine, "start", never_ready)
    server = engine_server.EngineServer(
        engine_options.ServerOptions(
            tls=ServerTls(certs.server_cert, certs.server_key, client_ca=certs.ca)
        )
    )
    await server.start()
    yield server
    await server.drain(grace=0)


async def test_mutual_tls_server_accepts_only_clients_with_a_certificate(
    tls_server: engine_server.EngineServer, certs: Certificates
) -> None:
    address = tls_server.address
    with_cert = TlsConfig(
        root_certificates=certs.ca,
        client_certificate=certs.client_cert,
        client_key=certs.client_key,
    )
    async with with_cert_channel(address, with_cert) as channel:
        assert await liveness(channel) == health_pb2.HealthCheckResponse.SERVING
    for refused in (TlsConfig(root_certificates=certs.ca), None):
        async with with_cert_channel(address, refused) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await liveness(channel)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def with_cert_channel(address: str, tls: TlsConfig | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.credentials())


async def test_router_serves_tls_and_reaches_mtls_backends(certs: Certificates) -> None:
    server_tls = ServerTls(certs.server_cert, certs.server_key, client_ca=certs.ca)
    backend = await FakeBackend("secure").start(tls=server_tls)
    router = RouterServer(
        RouterOptions(
            backends=[backend.address],
            health_check_interval=0.1,
            tls=ServerTls(certs.server_cert, certs.server_key),
            backend_tls=TlsConfig(certs.ca, certs.client_cert, certs.client_key),
        )
    )
    await router.start()
    await router.wait_healthy(1)  # the health watch itself runs over mutual TLS
    client = InferenceClient(router.address, tls=TlsConfig(root_certificates=certs.ca))
    result = await client.generate([1, 2], gen.SamplingParams(max_tokens=4))
    assert result.token_ids == [0, 1, 2, 3]
    await client.close()
    async with grpc.aio.insecure_channel(router.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await data_plane_pb2_grpc.DataPlaneStub(plain).GetModelInfo(
                data_plane_pb2.GetModelInfoRequest(), timeout=30
            )
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    await router.stop(0)
    await backend.stop()


def test_tls_flags_reach_the_options(certs: Certificates, tmp_path: Path) -> None:
    args = engine_options.build_parser().parse_args(
        [
            "--tls-cert",
            certs.server_cert,
            "--tls-key",
            certs.server_key,
            "--tls-client-ca",
            certs.ca,
            "--catch-up-from",
            "127.0.0.1:1",
            "--peer-tls-ca",
            certs.ca,
            "--peer-tls-cert",
            certs.client_cert,
            "--peer-tls-key",
            certs.client_key,
        ]
    )
    options = engine_options.options_from_args(args)
    assert options.tls == ServerTls(certs.server_cert, certs.server_key, certs.ca)
    assert options.peer_tls == TlsConfig(certs.ca, certs.client_cert, certs.client_key)
    from servers.router import router_server as router

    routed = router.options_from_args(
        router.build_parser().parse_args(
            [
                "--tls-cert",
                certs.server_cert,
                "--tls-key",
                certs.server_key,
                "--backend-tls-ca",
                certs.ca,
            ]
        )
    )
    assert routed.tls is not None and routed.backend_tls == TlsConfig(certs.ca, None, None)


@pytest.mark.engine
async def test_a_server_catches_up_from_a_mutual_tls_peer(
    certs: Certificates, tiny_model_dir: Path
) -> None:
    """A fleet on mutual TLS: a server started with --catch-up-from a peer and the peer TLS
    flags (CA, client certificate) reads the peer's weights before it serves, bit-identical.
    Weights go over gRPC (TLS), not the push socket, which a TLS server does not open."""
    from safetensors.torch import load_file

    from tests.helpers.weights import perturbed

    mutual = ServerTls(certs.server_cert, certs.server_key, client_ca=certs.ca)
    as_client = TlsConfig(certs.ca, certs.client_cert, certs.client_key)
    peer = engine_server.EngineServer(engine_options.ServerOptions(tls=mutual))
    await peer.start()
    late = None
    try:
        await asyncio.wait_for(peer.wait_ready(), timeout=ENGINE_START_SECONDS)
        assert peer.push_socket is None, "the push socket is not encrypted: none with TLS"
        client = InferenceClient(peer.address, [peer.address], tls=as_client)
        weights = perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=4)
        await client.update_weights(weights.items(), 2)
        late = engine_server.EngineServer(
            engine_options.ServerOptions(
                tls=mutual, catch_up_from=[peer.address], peer_tls=as_client
            )
        )
        await late.start()
        await asyncio.wait_for(late.wait_ready(), timeout=ENGINE_START_SECONDS)
        both = InferenceClient(peer.address, [peer.address, late.address], tls=as_client)
        assert dict(await both.weight_versions()) == {peer.address: 2, late.address: 2}
        sums = await both.weight_checksums()
        assert sums[late.address] == sums[peer.address] and sums[peer.address]
        await both.close()
        await client.close()
    finally:
        for server in (late, peer):
            if server is not None:
                await server.drain(grace=0)


async def test_tls_takes_pem_bytes_or_paths_and_refuses_anything_else_when_made(
    tls_server: engine_server.EngineServer, certs: Certificates, tmp_path: Path
) -> None:
    """gRPC's own convention (PEM bytes) works as paths do; what cannot work is refused when
    the config is made, naming the field (PEM bytes were a TypeError at the first call)."""
    pem = {name: Path(path).read_bytes() for name, path in [  # noqa: ASYNC240
        ("root_certificates", certs.ca),
        ("client_certificate", certs.client_cert),
        ("client_key", certs.client_key),
    ]}  # fmt: skip
    as_bytes = TlsConfig(**pem)  # type: ignore[arg-type]  # bytes where the type says paths
    async with with_cert_channel(tls_server.address, as_bytes) as channel:
        assert await liveness(channel) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(ValueError, match=r"root_certificates: bytes that are not PEM"):
        TlsConfig(root_certificates=b"not a certificate")
    with pytest.raises(ValueError, match=r"root_certificates: '.*no-such.pem' is not a file"):
        TlsConfig(root_certificates=str(tmp_path / "no-such.pem"))
    with pytest.raises(ValueError, match="client_certificate and client_key go together"):
        TlsConfig(root_certificates=certs.ca, client_certificate=certs.client_cert)
