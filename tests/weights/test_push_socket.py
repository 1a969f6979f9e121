"""The push socket: in-band weight updates on a plain TCP connection beside gRPC, into a real
engine server; the same checks and errors as PushWeights, and only for the open update."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

from servers.common.interceptors import CallCounter
from servers.engine.peers.peer_streams import StreamOutcome
from servers.engine.service.frame_buffers import FrameBuffers
from servers.engine.service.push_socket import PushSocketServer
from skyrl_grpc.chunk_wire import chunk_head
from skyrl_grpc.push_socket_client import host_of
from skyrl_grpc.socket_frames import FRAME_HEADER, recv_frame, send_frame
from skyrl_grpc.tensor_bytes import sha256_of
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from tests.helpers.waits import until
from tests.helpers.weights import next_version, perturbed
from trainer_client import InferenceClient
from trainer_client.exceptions import FailedPrecondition
from trainer_client.weights.push_lanes import PushSocket, PushSocketOffer, open_push_socket
from trainer_client.weights.weight_sending import PushStream, tensor_entries

OWNER = "push-socket-test"


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


async def served_checksums(client: InferenceClient, address: str) -> dict[str, bytes]:
    return (await client.weight_checksums())[address]


def sha256s(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: sha256_of(tensor) for name, tensor in weights.items()}


class OpenUpdate:
    """An update opened on the server with the stub (as a trainer's client does), cancelled
    on the way out: its push socket port and ticket."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

    async def __aenter__(self) -> cp.StartWeightUpdateResponse:
        request = cp.StartWeightUpdateRequest(owner=OWNER)
        return await self._stub.StartWeightUpdate(request, timeout=60)

    async def __aexit__(self, *_: object) -> None:
        try:
            await self._stub.CancelWeightUpdate(cp.CancelWeightUpdateRequest(), timeout=60)
        except grpc.aio.AioRpcError as error:  # already closed by the test's refusal
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def connected(port: int, ticket: bytes) -> PushSocket:
    return PushSocket.connect("engine", "127.0.0.1", PushSocketOffer(port, ticket), 60)


def reply_of(sock: socket.socket) -> cp.PushSocketReply:
    raw = recv_frame(sock, 1 << 20)
    assert raw is not None, "the server closed the connection without a reply"
    return cp.PushSocketReply.FromString(bytes(raw))


def hello(port: int, ticket: bytes) -> socket.socket:
    """A raw connection whose hello the server accepted."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    send_frame(sock, cp.PushSocketHello(ticket=ticket).SerializeToString())
    assert reply_of(sock).code == 0
    return sock


async def reply_to_stream(
    opened: cp.StartWeightUpdateResponse, frames: Sequence[Sequence[bytes | bytearray | memoryview]]
) -> cp.PushSocketReply:
    """A raw connection to ``opened``'s push socket: its hello, then ``frames`` (each a frame's
    parts) as one stream; the server's reply to it."""
    sock = await asyncio.to_thread(hello, opened.push_socket_port, opened.push_ticket)

    def send() -> cp.PushSocketReply:
        for frame in frames:
            send_frame(sock, *frame)
        send_frame(sock)
        return reply_of(sock)

    try:
        return await asyncio.to_thread(send)
    finally:
        sock.close()


@pytest.mark.engine
async def test_in_band_updates_go_over_the_push_socket_and_land_bit_exact(
    engine_server: Any, original: dict[str, torch.Tensor]
) -> None:
    """A client's in-band update (whole, then a delta) travels over the server's push socket
    and serves bit for bit what was sent; a client told ``push_socket=False`` sends the same
    over gRPC, and the socket sees none of it."""
    address, lane = engine_server.address, engine_server.push_socket
    assert lane is not None and lane.port > 0
    client = InferenceClient(address, [address], direct=False)
    grpc_only = InferenceClient(address, [address], direct=False, push_socket=False)
    try:
        weights = perturbed(original, seed=21)
        before = lane.streams_staged
        await client.update_weights(weights.items(), await next_version(client))
        assert lane.streams_staged > before
        assert await served_checksums(client, address) == sha256s(weights)

        step = {name: tensor.clone() for name, tensor in weights.items()}
        name = next(iter(step))
        step[name].view(-1)[:3] += 1.0  # a few elements: the delta is a patch
        before = lane.streams_staged
        await client.update_weights(step.items(), await next_version(client))
        assert lane.streams_staged == before + 1
        full_bytes = sum(t.numel() * t.element_size() for t in step.values())
        assert 0 < client.last_push_bytes[address] < full_bytes / 100
        assert await served_checksums(client, address) == sha256s(step)

        before = lane.streams_staged
        await grpc_only.update_weights(original.items(), await next_version(client))
        assert lane.streams_staged == before
        assert await served_checksums(client, address) == sha256s(original)
    finally:
        await client.close()
        await grpc_only.close()


@pytest.mark.engine
async def test_a_push_socket_takes_the_open_updates_ticket_and_no_other(
    engine_server: Any, engine_channel: grpc.aio.Channel
) -> None:
    """No update open, or a ticket that is not the open update's: the hello is refused with
    FAILED_PRECONDITION saying why. The open update's ticket is accepted, and a connection
    outliving its update cannot push into the next one."""
    port = engine_server.push_socket.port
    with pytest.raises(FailedPrecondition, match="before StartWeightUpdate"):
        await asyncio.to_thread(connected, port, b"no update is open")
    async with OpenUpdate(engine_channel) as opened:
        assert opened.push_socket_port == port and len(opened.push_ticket) == 16
        with pytest.raises(FailedPrecondition, match="ticket is not the open update's"):
            await asyncio.to_thread(connected, port, b"0" * 16)
        accepted = await asyncio.to_thread(connected, port, opened.push_ticket)
    async with OpenUpdate(engine_channel) as reopened:
        assert reopened.push_ticket != opened.push_ticket
        stream = PushStream(tensor_entries([("model.norm.weight", torch.ones(64))]))
        try:
            with pytest.raises(FailedPrecondition, match="ticket is not the open update's"):
                await asyncio.to_thread(accepted.send, stream)
        finally:
            accepted.close()


@pytest.mark.engine
async def test_a_corrupt_chunk_on_the_push_socket_is_refused_and_the_weights_stay(
    engine_server: Any, engine_channel: grpc.aio.Channel, original: dict[str, torch.Tensor]
) -> None:
    """A chunk whose bytes do not match its CRC-32: the stream is answered DATA_LOSS as
    PushWeights would be, the update is rejected, the previous weights keep serving and the
    server keeps serving."""
    address = engine_server.address
    client = InferenceClient(address, [address], direct=False)
    served = await served_checksums(client, address)
    name = "model.norm.weight"
    value = perturbed({name: original[name]}, seed=5)[name]
    frames = list(PushStream(tensor_entries([(name, value)])).frames())
    manifest, (head, data) = frames[0][0], frames[1]
    corrupt = bytearray(data)
    corrupt[0] ^= 0xFF
    async with OpenUpdate(engine_channel) as opened:
        reply = await reply_to_stream(opened, [(manifest,), (head, corrupt)])
    assert reply.code == grpc.StatusCode.DATA_LOSS.value[0]
    assert "checksum mismatch" in reply.message and name in reply.message
    assert await served_checksums(client, address) == served
    assert (await client.generate([1, 2, 3], {"max_tokens": 2})).token_ids
    await client.close()


@pytest.mark.engine
async def test_a_nan_on_the_push_socket_is_refused_and_the_weights_stay(
    engine_server: Any, engine_channel: grpc.aio.Channel, original: dict[str, torch.Tensor]
) -> None:
    """A value that is not finite: the stream is answered INVALID_ARGUMENT naming the parameter
    and the flag that would accept it, as PushWeights would be, and the previous weights keep
    serving."""
    address = engine_server.address
    client = InferenceClient(address, [address], direct=False)
    served = await served_checksums(client, address)
    name = "model.norm.weight"
    value = perturbed({name: original[name]}, seed=6)[name]
    value[-1] = float("nan")
    frames = list(PushStream(tensor_entries([(name, value)])).frames())
    async with OpenUpdate(engine_channel) as opened:
        reply = await reply_to_stream(opened, frames)
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert name in reply.message and "NaN or an infinity" in reply.message
    assert "--allow-non-finite-weights" in reply.message
    assert await served_checksums(client, address) == served
    await client.close()


@pytest.mark.engine
async def test_a_frame_over_the_message_size_is_refused_naming_the_flag(
    engine_server: Any, engine_channel: grpc.aio.Channel
) -> None:
    async with OpenUpdate(engine_channel) as opened:
        sock = await asyncio.to_thread(hello, opened.push_socket_port, opened.push_ticket)
        try:

            def send_oversized() -> tuple[cp.PushSocketReply, bytes]:
                sock.sendall(FRAME_HEADER.pack(1 << 40))
                reply = reply_of(sock)
                return reply, sock.recv(1)

            reply, after = await asyncio.to_thread(send_oversized)
        finally:
            sock.close()
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "--max-message-mib" in reply.message
    assert after == b"", "the connection closes after the refusal"


@pytest.mark.engine
async def test_a_trainer_gone_mid_stream_leaves_the_previous_weights_serving(
    engine_server: Any, engine_channel: grpc.aio.Channel, original: dict[str, torch.Tensor]
) -> None:
    address = engine_server.address
    client = InferenceClient(address, [address], direct=False)
    served = await served_checksums(client, address)
    updates = engine_server.state.parts().weights.updates
    name = "model.norm.weight"
    async with OpenUpdate(engine_channel) as opened:
        sock = await asyncio.to_thread(hello, opened.push_socket_port, opened.push_ticket)
        stream = PushStream(tensor_entries([(name, original[name] * 2)]))
        (manifest, _), (head, data) = list(stream.frames())

        def send_half() -> None:
            send_frame(sock, manifest)
            sock.sendall(FRAME_HEADER.pack(len(head) + len(data)) + head + bytes(data[:10]))
            sock.close()

        await asyncio.to_thread(send_half)
        await until(lambda: updates.open is None, what="the abandoned update to close")
    assert await served_checksums(client, address) == served
    await client.close()


async def test_a_push_socket_that_cannot_be_reached_leaves_the_update_to_grpc(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listening, no host:port address, no offer, or something else answering: no
    push socket (the update goes over gRPC), never an error."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    offer = PushSocketOffer(port, b"ticket")
    assert await open_push_socket(f"127.0.0.1:{port + 1}", offer, 5) is None
    assert "pushing over gRPC" in caplog.text
    assert await open_push_socket("unix:/tmp/engine.sock", offer, 5) is None
    # Something else answers on that port (a proxy in front of the server speaking HTTP).
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(1)

    def answer_http() -> None:
        connection, _ = other.accept()
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        connection.close()

    answering = asyncio.ensure_future(asyncio.to_thread(answer_http))
    http_offer = PushSocketOffer(other.getsockname()[1], b"ticket")
    assert await open_push_socket("127.0.0.1:50051", http_offer, 5) is None
    await answering
    other.close()
    assert await open_push_socket("127.0.0.1:50051", None, 5) is None


def test_the_host_of_an_address() -> None:
    assert host_of("10.0.0.7:50051") == "10.0.0.7"
    assert host_of("engine-3.cluster.local:50051") == "engine-3.cluster.local"
    assert host_of("[::1]:50051") == "::1"
    for target in ("unix:/tmp/s.sock", "dns:///engine:50051", "ipv4:10.0.0.7:50051", "engine"):
        assert host_of(target) is None, target


def test_a_chunks_head_and_data_are_the_grpc_message() -> None:
    """What the socket writes as a chunk's two parts is, joined, exactly the message the gRPC
    stream sends: the server reads both the same way."""
    stream = PushStream(tensor_entries([("w", torch.arange(3000, dtype=torch.float32))]), 4096)
    joined = [bytes(head) + bytes(data) for head, data in stream.frames()]
    assert joined == list(stream)
    assert len(joined) == 4 and chunk_head("w", 0, 4096, 1).endswith(b"\x80\x20")


def test_frame_memory_is_reused_once_no_view_of_it_is_left() -> None:
    """A buffer is handed out again only when nothing refers to what was read into it (a
    chunk's data is a view of its frame until staged), so memory stays flat across updates
    and nothing is overwritten while in use."""
    buffers = FrameBuffers()
    first = buffers.take(4 << 20)
    chunk_data = first[100:200]  # what a decoded chunk keeps of its frame
    first_buffer = id(first.obj)  # ids: a reference would keep the buffer in use
    del first
    second = buffers.take(4 << 20)
    assert id(second.obj) != first_buffer, "a buffer a chunk still refers to is not reused"
    second_buffer = id(second.obj)
    held = buffers.held_bytes
    del chunk_data, second
    for _ in range(10):
        frame = buffers.take(4 << 20)
        assert id(frame.obj) in (first_buffer, second_buffer)
        del frame
    assert buffers.held_bytes == held, "freed buffers are taken again, none added"
    small = buffers.take(100)
    assert len(small) == 100 and buffers.held_bytes == held, "small frames are not pooled"


async def test_a_stream_in_progress_is_a_call_a_drain_waits_for() -> None:
    """A stream counts as a call in progress from its first frame until its reply is sent, so
    a draining server lets it finish within its grace, as it does a PushWeights call. (The
    subject is the socket's accounting: the push it feeds is a stand-in.)"""
    calls = CallCounter()
    pushing, release = asyncio.Event(), asyncio.Event()

    class Streams:
        def check_sender(self, ticket: bytes | None, relayed_from: str, tree: int | None) -> None:
            pass

        async def stage(
            self,
            ticket: bytes | None,
            relayed_from: str,
            tree: int | None,
            messages: AsyncIterator[Any],
        ) -> tuple[StreamOutcome, str]:
            received = [item async for item in messages]
            pushing.set()
            await release.wait()
            return StreamOutcome(staged=len(received)), ""

    server = PushSocketServer("127.0.0.1", 0, Streams(), 1 << 20, calls)
    server.start()
    lane = await asyncio.to_thread(connected, server.port, b"ticket")
    stream = PushStream(tensor_entries([("w", torch.ones(8))]))
    try:
        sending = asyncio.ensure_future(asyncio.to_thread(lane.send, stream))
        await pushing.wait()
        assert calls.active == 1 and not await calls.wait_idle(0.05)
        release.set()
        assert (await sending).parameters_staged == 2  # the manifest and the one chunk
        assert await calls.wait_idle(60)
    finally:
        lane.close()
        await server.close()
