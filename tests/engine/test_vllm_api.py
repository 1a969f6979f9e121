"""vLLM's own gRPC contract (its Rust front end's ``vllm.Inference`` and ``vllm.Control``, stubs
generated from the .proto files of vLLM's release) on this stack's engine server: a client of
vLLM's protocol generates what the DataPlane generates, pauses, reads the weight version and
updates the weights as vLLM's trainer sends them (its JSON init and update infos, its packed
buffers made by vLLM's own ``pack_tensors``) with the same result as this stack's own calls;
what has no mapping is refused UNIMPLEMENTED, naming the call to use instead."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from skyrl_grpc.process_group import join_group, master_store
from skyrl_grpc.tensor_bytes import sha256_of
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from skyrl_grpc.vllm_api import control_pb2 as vc
from skyrl_grpc.vllm_api import control_pb2_grpc, inference_pb2_grpc
from skyrl_grpc.vllm_api import inference_pb2 as vi
from tests.conftest import REFERENCE_PROMPTS
from tests.helpers.weights import GREEDY, MAX_TOKENS, perturbed
from trainer_client import InferenceClient
from trainer_client.weights.weight_sending import push_messages

pytestmark = [pytest.mark.engine]
INFERENCE, CONTROL = "vllm.Inference", "vllm.Control"


@pytest.fixture(scope="module")
async def vllm_stubs(
    engine_server: Any,
) -> AsyncIterator[tuple[inference_pb2_grpc.InferenceStub, control_pb2_grpc.ControlStub]]:
    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel), control_pb2_grpc.ControlStub(channel)


def greedy(prompt: list[int], **fields: Any) -> vi.GenerateRequest:
    defaults: dict[str, Any] = {
        "temperature": 0.0,
        "stopping": vi.StoppingCriteria(max_new_tokens=MAX_TOKENS, ignore_eos=True),
        "response": vi.ResponseOptions(output_token_ids=True),
    }
    return vi.GenerateRequest(token_ids=vi.TokenIds(ids=prompt), **(defaults | fields))


async def streamed(inference: Any, request: vi.GenerateRequest) -> list[vi.GenerateResponse]:
    return [response async for response in inference.GenerateStream(request)]


async def test_vllm_inference_generates_what_the_data_plane_does(
    engine_server: Any, vllm_stubs: Any
) -> None:
    inference, _ = vllm_stubs
    ours = InferenceClient(engine_server.address, [engine_server.address])
    try:
        for prompt in REFERENCE_PROMPTS:
            expected = (await ours.generate(prompt, GREEDY)).token_ids
            whole = await inference.Generate(greedy(prompt))
            assert list(whole.outputs.token_ids) == expected
            assert whole.prompt_info.num_prompt_tokens == len(prompt)
            info = whole.outputs.finish_info
            assert info.finish_reason == vi.FinishInfo.LENGTH
            assert info.num_output_tokens == MAX_TOKENS
            # Streamed: the prompt's facts first, then chunks; the text is the tokens'.
            responses = await streamed(inference, greedy(prompt))
            assert responses[0].HasField("prompt_info") and not responses[0].HasField("outputs")
            chunks = [r.outputs for r in responses[1:]]
            assert [t for c in chunks for t in c.token_ids] == expected
            assert "".join(c.text for c in chunks) == await ours.detokenize(expected)
            assert [c.HasField("finish_info") for c in chunks][-1]
        # A text prompt is tokenized as the DataPlane's Tokenize does it.
        text = "The quick brown fox"
        by_text = await inference.Generate(
            vi.GenerateRequest(
                text=text,
                stopping=vi.StoppingCriteria(max_new_tokens=8, ignore_eos=True),
                response=vi.ResponseOptions(output_token_ids=True, prompt_token_ids=True),
            )
        )
        prompt = await ours.tokenize(text)
        assert list(by_text.prompt_info.token_ids) == prompt
        assert (
            list(by_text.outputs.token_ids)
            == (await ours.generate(prompt, {**GREEDY, "max_tokens": 8})).token_ids
        )
    finally:
        await ours.close()


async def test_vllm_inference_streams_n_samples_with_logprobs_and_stops_with_a_reason(
    vllm_stubs: Any,
) -> None:
    inference, _ = vllm_stubs
    request = vi.GenerateRequest(
        token_ids=vi.TokenIds(ids=REFERENCE_PROMPTS[0]),
        temperature=1.0,
        sampling=vi.RandomSampling(num_sequences=2, seed=7),
        stopping=vi.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
        response=vi.ResponseOptions(
            output_token_ids=True,
            output_logprobs=True,
            output_candidates=vi.CandidateTokens(top_n=2),
        ),
    )
    samples: dict[int, list[vi.SequenceOutput]] = {}
    for response in (await streamed(inference, request))[1:]:
        samples.setdefault(response.outputs.index, []).append(response.outputs)
    assert sorted(samples) == [0, 1]
    for outputs in samples.values():
        tokens = [t for o in outputs for t in o.token_ids]
        assert len(tokens) == 6 == outputs[-1].finish_info.num_output_tokens
        assert len([v for o in outputs for v in o.logprobs]) == 6
        candidates = [c for o in outputs for c in o.candidate_tokens]
        assert len(candidates) == 6 and all(len(c.tokens) == 2 for c in candidates)
        assert all(v <= 0 for o in outputs for v in o.logprobs)
    # A stop token ends a sample with STOP, naming the token.
    first = (await inference.Generate(greedy(REFERENCE_PROMPTS[1]))).outputs.token_ids[2]
    stopped = await inference.Generate(
        greedy(
            REFERENCE_PROMPTS[1],
            stopping=vi.StoppingCriteria(max_new_tokens=MAX_TOKENS, stop_token_ids=[first]),
        )
    )
    info = stopped.outputs.finish_info
    assert info.finish_reason == vi.FinishInfo.STOP and info.stop_token_id == first


async def test_vllm_services_are_in_health_reflection_and_capabilities(engine_server: Any) -> None:
    ours = InferenceClient(engine_server.address, [engine_server.address])
    try:
        info = (await ours.server_info())[engine_server.address]
        assert {INFERENCE, CONTROL} <= set(info.capabilities.protocols)
    finally:
        await ours.close()
    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in (INFERENCE, CONTROL):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        control = control_pb2_grpc.ControlStub(channel)
        server = await control.GetServerInfo(vc.GetServerInfoRequest())
        engine = engine_server.state.parts().engine
        assert server.max_model_len == engine.max_model_len and server.api_version == "vllm"
        assert server.kv_block_size > 0 and server.total_kv_blocks > 0
        assert server.rl_capabilities.weight_transfer_backend == "gloo"  # a CPU engine
        assert not server.rl_capabilities.sleep_mode_enabled
        model = await control.GetModelInfo(vc.GetModelInfoRequest())
        assert model.served_model_name == engine.served_model_name
        assert model.supports_token_ids_input and not model.supports_lora
        # No KV-event publisher on these servers: no sources (SMG's cache-aware policy sees none).
        assert not (await control.GetKvEventSources(vc.GetKvEventSourcesRequest())).sources
        assert not (await control.ListLoras(vc.ListLorasRequest())).adapters


async def test_vllm_control_pauses_and_resumes_this_servers_generation(
    engine_server: Any, vllm_stubs: Any
) -> None:
    inference, control = vllm_stubs
    ours = InferenceClient(engine_server.address, [engine_server.address])
    try:
        await control.PauseGeneration(vc.PauseGenerationRequest(mode=vc.PAUSE_MODE_KEEP))
        assert (await control.IsPaused(vc.IsPausedRequest())).paused
        assert all((await ours.is_paused()).values())
        # A request made while paused waits (it does not fail), and runs on resume.
        waiting = asyncio.ensure_future(inference.Generate(greedy(REFERENCE_PROMPTS[0])))
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done
        await control.ResumeGeneration(vc.ResumeGenerationRequest())
        assert len((await waiting).outputs.token_ids) == MAX_TOKENS
        assert not (await control.IsPaused(vc.IsPausedRequest())).paused
        # A CPU engine cannot sleep: refused, saying so, and nothing is paused.
        for call in (
            control.Sleep(vc.SleepRequest(level=1, mode=vc.PAUSE_MODE_WAIT)),
            control.WakeUp(vc.WakeUpRequest()),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "cpu" in (refused.value.details() or "")
        assert not (await control.IsSleeping(vc.IsSleepingRequest())).sleeping
        assert not (await control.IsPaused(vc.IsPausedRequest())).paused
        # Abort by request id ends a running stream with ABORTED (held by a pause in KEEP
        # mode meanwhile, so it cannot finish first).
        long = greedy(REFERENCE_PROMPTS[2], request_id="vllm-abort-me")
        long.stopping.max_new_tokens = 400
        stream = inference.GenerateStream(long)
        await stream.read()  # the prompt's facts: the request runs
        await control.PauseGeneration(vc.PauseGenerationRequest(mode=vc.PAUSE_MODE_KEEP))
        await control.Abort(vc.AbortRequest(request_ids=["vllm-abort-me"]))
        last = await stream.read()
        while not last.outputs.HasField("finish_info"):
            last = await stream.read()
        assert last.outputs.finish_info.finish_reason == vi.FinishInfo.ABORTED
        assert last.outputs.finish_info.num_output_tokens < 400
    finally:
        await ours.resume()
        await ours.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_trainer_sends(
    weights: dict[str, torch.Tensor], port: int, packed: bool, buffer_bytes: int
) -> None:
    """Rank 0 of the group, sending as vLLM's trainer engine does: each tensor on its own, or
    packed into byte buffers by vLLM's own ``pack_tensors``, broadcast one after another."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    store = master_store("127.0.0.1", port, 2, 60)
    group = join_group("gloo", "127.0.0.1", port, 0, 2, "default", 60, store=store)
    if packed:
        items = iter(weights.items())
        while (chunk := pack_tensors(items, lambda item: item[1], buffer_bytes)) is not None:
            group.broadcast(chunk.packed_tensor, 0).wait()
    else:
        for tensor in weights.values():
            group.broadcast(tensor.contiguous(), 0).wait()
    del store


async def vllm_update(
    control: Any, weights: dict[str, torch.Tensor], version: str | None, packed: bool
) -> None:
    """A whole update as a client of vLLM's Control sends it: init, start, update, finish."""
    port, buffer_bytes = free_port(), 300_000
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    init |= {"packed": packed, "packed_buffer_size_bytes": buffer_bytes}
    update = {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }
    trainer = asyncio.ensure_future(
        asyncio.to_thread(vllm_trainer_sends, weights, port, packed, buffer_bytes)
    )
    await control.InitWeightTransferEngine(
        vc.InitWeightTransferEngineRequest(init_info_json=json.dumps(init).encode())
    )
    await control.StartWeightUpdate(vc.StartWeightUpdateRequest())
    await control.UpdateWeights(
        vc.UpdateWeightsRequest(update_info_json=json.dumps(update).encode())
    )
    await trainer
    finish = vc.FinishWeightUpdateRequest()
    if version is not None:
        finish.weight_version = version
    await control.FinishWeightUpdate(finish)


async def test_vllm_control_updates_weights_as_vllms_trainer_sends_them(
    engine_server: Any, engine_channel: grpc.aio.Channel, vllm_stubs: Any, tiny_model_dir: Path
) -> None:
    """Packed buffers, in-band chunks, one tensor at a time: each update serves exactly the
    weights sent (checksums, and greedy tokens the same through both protocols), under the
    version named or the next."""
    engine_server_channel = engine_channel
    inference, control = vllm_stubs
    ours = InferenceClient(engine_server.address, [engine_server.address])
    address = engine_server.address
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    new = perturbed(original, seed=11)
    before = int((await control.GetWeightVersion(vc.GetWeightVersionRequest())).weight_version)
    assert before == (await ours.weight_versions())[address]
    try:
        await vllm_update(control, new, str(before + 1), packed=True)
        assert (await control.GetWeightVersion(vc.GetWeightVersionRequest())).weight_version == str(
            before + 1
        )
        assert (await ours.weight_checksums())[address] == {n: sha256_of(t) for n, t in new.items()}
        on_ours = (await ours.generate(REFERENCE_PROMPTS[0], GREEDY)).token_ids
        assert (
            list((await inference.Generate(greedy(REFERENCE_PROMPTS[0]))).outputs.token_ids)
            == on_ours
        )
        # In-band: vLLM's Start and Finish around this stack's PushWeights, one update;
        # without a version, Finish makes it the next number.
        pushed = perturbed(original, seed=12)
        await control.StartWeightUpdate(vc.StartWeightUpdateRequest())
        stub = control_plane_pb2_grpc.ControlPlaneStub(engine_server_channel)
        messages = push_messages(pushed.items(), chunk_bytes=1 << 20)
        await stub.PushWeights(iter([cp.PushWeightsRequest.FromString(m) for m in messages]))
        await control.FinishWeightUpdate(vc.FinishWeightUpdateRequest())
        assert (await ours.weight_versions())[address] == before + 2
        sums = (await ours.weight_checksums())[address]
        assert sums == {n: sha256_of(t) for n, t in pushed.items()}
        # Unpacked, one tensor per broadcast: the original weights back.
        await vllm_update(control, original, str(before + 3), packed=False)
        assert (await ours.weight_versions())[address] == before + 3
        sums = (await ours.weight_checksums())[address]
        assert sums == {n: sha256_of(t) for n, t in original.items()}
    finally:
        await ours.close()


async def test_vllm_control_refuses_what_it_cannot_map_and_keeps_serving(
    engine_server: Any, vllm_stubs: Any
) -> None:
    inference, control = vllm_stubs
    refusals: list[tuple[Any, grpc.StatusCode, str]] = [
        (
            control.UpdateWeightVersion(vc.UpdateWeightVersionRequest(weight_version="7")),
            grpc.StatusCode.UNIMPLEMENTED,
            "FinishWeightUpdate",
        ),
        (
            control.StartDraftWeightUpdate(vc.StartDraftWeightUpdateRequest()),
            grpc.StatusCode.UNIMPLEMENTED,
            "StartWeightUpdate",
        ),
        (
            inference.Generate(
                greedy(
                    [1, 2, 3],
                    decoding=vi.DecodingParameters(bad_words_token_ids=[vi.TokenIds(ids=[5])]),
                )
            ),
            grpc.StatusCode.UNIMPLEMENTED,
            "logit_bias",
        ),
        (
            inference.Generate(greedy([1, 2, 3], sampling=vi.RandomSampling(num_sequences=2))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "GenerateStream",
        ),
        (
            inference.Generate(greedy([1, 2, 3], model="another-model")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "this server serves",
        ),
        (
            control.InitWeightTransferEngine(
                vc.InitWeightTransferEngineRequest(init_info_json=b"[1, 2]")
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "JSON object",
        ),
        (
            control.FinishWeightUpdate(vc.FinishWeightUpdateRequest(weight_version="v-next")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "decimal integer",
        ),
        (
            inference.Generate(vi.GenerateRequest()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt is required",
        ),
    ]
    for call, code, words in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == code, refused.value.details()
        assert words in (refused.value.details() or ""), refused.value.details()
    whole = await inference.Generate(greedy(REFERENCE_PROMPTS[0]))
    assert len(whole.outputs.token_ids) == MAX_TOKENS


async def test_vllm_control_shutdown_drains_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown drains as SIGTERM does: the call answers, then the server stops. (Its engine is
    never started: the subject is the call's path to the server's drain.)"""
    from servers.engine.options import ServerOptions
    from servers.engine.process.engine_server import EngineServer
    from servers.engine.vllm_adapter.vllm_engine import VllmEngine

    async def never_ready(*_: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(VllmEngine, "start", never_ready)
    server = EngineServer(ServerOptions())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            await control_pb2_grpc.ControlStub(channel).Shutdown(vc.ShutdownRequest())
        await asyncio.wait_for(server.wait_stopped(), timeout=60)
    finally:
        await server.drain(grace=0)
