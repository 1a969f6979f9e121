"""What a server says it can do (``GetServerInfo``'s capabilities) and the trainer client
refusing, before sending anything, a fleet-wide call a server cannot take: one line naming the
server and what would let it (a sleep on a CPU engine, a LoRA adapter on a server started
without ``--enable-lora``, a collective backend the server does not take)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from servers.engine.service.vllm_protocol import VLLM_ENGINE
from skyrl_grpc.names import CONTROL_PLANE, DATA_PLANE, SERVER_STATUS
from tests.helpers.adapters import make_adapter
from trainer_client import FanOutError, InferenceClient, Unsupported

pytestmark = [pytest.mark.engine]


async def listed_services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in stub.ServerReflectionInfo(iter([request])):
            return {s.name for s in answer.list_services_response.service}
    return set()


async def test_a_server_names_the_protocols_it_answers(engine_server: Any) -> None:
    client = InferenceClient(engine_server.address, [engine_server.address])
    try:
        [info] = (await client.server_info()).values()
    finally:
        await client.close()
    protocols = set(info.capabilities.protocols)
    vllms = {VLLM_ENGINE, "vllm.Inference", "vllm.Control"}  # vLLM's own, beside ours
    assert protocols == {DATA_PLANE, CONTROL_PLANE, SERVER_STATUS, *vllms}
    assert protocols <= await listed_services(engine_server.address)
    assert not info.capabilities.sleep and not info.capabilities.lora.enabled  # CPU, no LoRA


async def test_calls_a_server_cannot_take_are_refused_before_they_are_sent(
    engine_server: Any, tiny_model_dir: Any
) -> None:
    address = engine_server.address
    client = InferenceClient(address, [address])
    try:
        with pytest.raises(Unsupported) as asleep:
            await client.sleep()
        assert not isinstance(asleep.value, FanOutError)
        message = str(asleep.value)
        assert message.startswith("sleep refused before it was sent to any server: ")
        assert address in message and "runs on cpu" in message
        assert asleep.value.servers.keys() == {address}
        assert not any((await client.is_sleeping()).values())

        tensors, config = make_adapter(tiny_model_dir, seed=3)
        with pytest.raises(Unsupported, match="start it with --enable-lora") as no_lora:
            await client.load_lora("refused", tensors=tensors, config=config)
        assert address in str(no_lora.value)
        assert not (await client.list_loras())[address]

        with pytest.raises(Unsupported, match=r"takes weights by .*gloo.*, not nccl") as group:
            await client.init_weight_transfer("nccl", timeout_seconds=5)
        assert "init_weight_transfer('nccl')" in str(group.value)
        assert not client.has_weight_group
    finally:
        await client.close()


async def test_a_generation_asking_for_routed_experts_is_refused_before_it_is_sent(
    engine_server: Any,
) -> None:
    """This CPU engine cannot capture routed experts (vLLM refuses the flag here), so its
    server says so, and the client refuses a generation that asks for them before sending it
    (``Unsupported``, raised here, not the server's FAILED_PRECONDITION), batched or not."""
    address = engine_server.address
    client = InferenceClient(address, [address], direct=False)
    asking = {"max_tokens": 2, "return_routed_experts": True}
    try:
        [info] = (await client.server_info()).values()
        assert not info.capabilities.routed_experts
        for call in (
            lambda: client.generate([1, 2, 3], asking),
            lambda: client.generate_batch([[1, 2, 3]], asking),
        ):
            with pytest.raises(Unsupported) as refused:
                await call()
            message = str(refused.value)
            assert message.startswith("return_routed_experts refused before it was sent")
            assert address in message and "--enable-return-routed-experts" in message
        assert (await client.generate([1, 2, 3], {"max_tokens": 2})).token_ids  # others go on
    finally:
        await client.close()


def test_a_server_that_captures_routed_experts_says_so() -> None:
    from servers.engine.domain.descriptions import ServerDescription
    from servers.engine.domain.lora_adapters import AdapterLimits
    from servers.engine.service.control_convert import server_info_to_proto
    from trainer_client import ServerInfo

    fields: dict[str, Any] = dict(
        world_size=1, tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
        weight_group_ranks=1, sleep_supported=True, weight_transfer_backends=["nccl"],
        prefix_caching=True, weight_version=0, engine="vllm", engine_version="x",
        served_model_name="m", device="cuda",
    )  # fmt: skip
    for captures in (True, False):
        lora = AdapterLimits(enabled=False)
        description = ServerDescription(lora=lora, routed_experts=captures, **fields)
        info = ServerInfo.from_proto(server_info_to_proto(description))
        assert info.capabilities.routed_experts is captures
        assert (info.capabilities.cannot_return_routed_experts() is None) is captures
