"""The router's fallback to plain GenerateStream calls for a server without GenerateMultiplex
(an older build, another implementation), over real sockets with stand-in backends."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from skyrl_grpc.errors import TRANSPORT_BROKE
from skyrl_grpc.multiplex import Multiplexer, WithFallback
from skyrl_grpc.names import GENERATE_STREAM
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.conftest import running_router
from tests.helpers.fake_backend import FakeBackend

REQUEST = data_plane_pb2.GenerateStreamRequest(
    prompt_token_ids=[1, 2], sampling_params=gen.SamplingParams(max_tokens=5)
)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def test_a_server_without_multiplexing_gets_plain_calls() -> None:
    """It answers UNIMPLEMENTED once; the stream goes as its own call and so do the next."""
    backend = await FakeBackend("old", delay=0.001).start()
    try:
        async for router in running_router([backend.address]):
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = data_plane_pb2_grpc.DataPlaneStub(channel)
                for _ in range(2):
                    chunks = [c async for c in stub.GenerateStream(REQUEST)]
                    assert [t for c in chunks for t in c.token_ids] == [0, 1, 2, 3, 4]
            assert not router.proxy.multiplexers.supported(backend.address)
            assert backend.observed.calls == 2  # each stream a GenerateStream call of its own
    finally:
        await backend.stop()


class FailingMuxStream:
    """A multiplexed stream whose call failed with ``error`` before it delivered anything."""

    def __init__(self, error: grpc.aio.AioRpcError, call_answered: bool) -> None:
        self.error = error
        self.call_answered = call_answered

    async def read(self) -> Any:
        raise self.error

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True


class PlainCall:
    def __init__(self) -> None:
        self.messages = [b"first", grpc.aio.EOF]

    async def read(self) -> Any:
        return self.messages.pop(0)


@pytest.mark.parametrize(
    ("code", "details", "call_answered", "settled_by_plain_call", "marked_unsupported"),
    [
        (grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!", False, True, True),
        # grpc's disguise of that answer when it beats the first request's write
        (grpc.StatusCode.INTERNAL, TRANSPORT_BROKE, False, True, False),
        # the same status on a call the server answered before: a connection that broke
        (grpc.StatusCode.INTERNAL, TRANSPORT_BROKE, True, False, False),
        (grpc.StatusCode.UNAVAILABLE, "connection refused", False, False, False),
        (grpc.StatusCode.INTERNAL, "the engine failed", False, False, False),
    ],
)
async def test_which_failures_of_a_new_multiplexed_call_a_plain_call_settles(
    code: grpc.StatusCode,
    details: str,
    call_answered: bool,
    settled_by_plain_call: bool,
    marked_unsupported: bool,
) -> None:
    unsupported: list[bool] = []
    plain = PlainCall()
    make_plain: Callable[[], PlainCall] = lambda: plain  # noqa: E731
    stream = WithFallback(
        FailingMuxStream(rpc_error(code, details), call_answered),  # type: ignore[arg-type]
        make_plain,
        lambda: unsupported.append(True),
    )
    if settled_by_plain_call:
        assert await stream.read() == b"first"
        assert await stream.read() is grpc.aio.EOF
    else:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stream.read()
        assert raised.value.code() == code
    assert unsupported == ([True] if marked_unsupported else [])


@pytest.mark.slow  # a thousand calls
async def test_every_new_multiplexed_call_to_a_server_without_it_ends_in_its_tokens() -> None:
    """Each try opens GenerateMultiplex on a fresh connection, as a router does for a server
    it has not yet learnt lacks it; without the plain-call settlement about one in a thousand
    (more on a busy machine) failed INTERNAL, which the router read as a lost server."""
    backend = await FakeBackend("old", delay=0.0).start()
    one_token = data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=[1], sampling_params=gen.SamplingParams(max_tokens=1)
    )
    try:
        for _ in range(1000):
            async with grpc.aio.insecure_channel(backend.address) as channel:
                generate: Any = channel.unary_stream(GENERATE_STREAM)
                plain_call = functools.partial(generate, one_token.SerializeToString())
                stream = WithFallback(
                    Multiplexer(channel, ()).open(one_token, ""), plain_call, lambda: None
                )
                message = await stream.read()
                assert data_plane_pb2.GenerateStreamResponse.FromString(message).token_ids == [0]
    finally:
        await backend.stop()
