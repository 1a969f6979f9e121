"""The one mapping from exceptions to statuses (``servers.common.interceptors``), over a real
in-process server with a stand-in service: domain errors keep their code and message,
anything unexpected becomes INTERNAL without leaking its text, undecodable requests are
INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from servers.common.interceptors import ErrorMappingInterceptor
from skyrl_grpc.errors import FailedPrecondition, NotFound
from skyrl_grpc.v1 import data_plane_pb2

SERVICE = "test.Errors"
Request = data_plane_pb2.TokenizeRequest
Response = data_plane_pb2.TokenizeResponse


class Behaviour:
    def __init__(self) -> None:
        self.raise_next: BaseException | None = None

    async def unary(self, request: Request, context: Any) -> Response:
        if self.raise_next is not None:
            raise self.raise_next
        return Response(token_ids=[len(request.text)])

    async def stream(self, request: Request, context: Any) -> AsyncIterator[Response]:
        yield Response(token_ids=[1])
        if self.raise_next is not None:
            raise self.raise_next

    async def upload(self, requests: AsyncIterator[bytes], context: Any) -> Response:
        """Refuses an upload at its first message, as a weight push refused mid-stream."""
        async for _ in requests:
            if self.raise_next is not None:
                raise self.raise_next
        return Response()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Behaviour, grpc.aio.Channel]]:
    behaviour = Behaviour()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(
            behaviour.unary, Request.FromString, Response.SerializeToString
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            behaviour.stream, Request.FromString, Response.SerializeToString
        ),
        "Upload": grpc.stream_unary_rpc_method_handler(
            behaviour.upload, None, Response.SerializeToString
        ),
    }
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield behaviour, channel
    await server.stop(0)


def unary(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/Unary",
        request_serializer=Request.SerializeToString,
        response_deserializer=Response.FromString,
    )


async def test_domain_errors_keep_their_status_and_message(served: Any) -> None:
    behaviour, channel = served
    for error, code in [
        (FailedPrecondition("open an update first"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotFound("no adapter 'x'"), grpc.StatusCode.NOT_FOUND),
    ]:
        behaviour.raise_next = error
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await unary(channel)(Request(text="a"))
        assert raised.value.code() == code
        assert raised.value.details() == str(error)


async def test_anything_unexpected_is_internal_with_a_generic_message(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    behaviour, channel = served
    behaviour.raise_next = RuntimeError("secret detail of the failure")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await unary(channel)(Request(text="a"))
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    details = raised.value.details() or ""
    assert details == f"internal error in /{SERVICE}/Unary; see server log"
    assert "secret detail" in caplog.text  # the traceback goes to the log, not the wire
    stream = channel.unary_stream(
        f"/{SERVICE}/Stream",
        request_serializer=Request.SerializeToString,
        response_deserializer=Response.FromString,
    )(Request(text="a"))
    assert list((await stream.read()).token_ids) == [1]  # what came before the error arrives
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stream.read()
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    behaviour.raise_next = None
    assert list((await unary(channel)(Request(text="abc"))).token_ids) == [3]  # still serving


async def test_a_request_that_does_not_decode_is_invalid_argument(served: Any) -> None:
    _, channel = served
    raw = channel.unary_unary(f"/{SERVICE}/Unary")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await raw(b"\xff\xff\xff")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"not a valid message for /{SERVICE}/Unary" in (raised.value.details() or "")


@pytest.mark.slow  # 3 GB through loopback
async def test_an_upload_refused_mid_stream_ends_with_its_status(served: Any) -> None:
    """Refused at its first message while its caller still sends (100 MB), the call ends with
    the refusal's status at the caller, every time: answered mid-send, grpc's client reported
    one such call in four as INTERNAL "Internal error from Core", a broken connection."""
    behaviour, channel = served
    behaviour.raise_next = FailedPrecondition("the update moved on to version 3")
    upload = channel.stream_unary(f"/{SERVICE}/Upload", response_deserializer=Response.FromString)
    for _ in range(32):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await upload(iter([bytes(4_000_000)] * 25))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.details() == "the update moved on to version 3"
