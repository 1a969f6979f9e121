"""LoRA adapters end to end against real vLLM (tiny model): pushed in-band to two servers,
chosen per request through the router, versioned, checked, unloaded. References are computed
independently: transformers with the adapter merged into the base weights (W + alpha/r * B A).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc
from tests.conftest import running_engine_server
from tests.helpers.adapters import make_adapter, merged_reference
from tests.helpers.waits import running_on_engines
from trainer_client import FanOutError, InferenceClient
from trainer_client.exceptions import ServerError
from trainer_client.weights.weight_sending import lora_push_messages

pytestmark = pytest.mark.engine
PROMPTS = [[1, 17, 33, 95, 200, 311], [1, 5, 9, 13, 400, 77, 78]]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
async def lora_fleet(tiny_model_dir: Path) -> AsyncIterator[tuple[Any, list[Any]]]:
    """Two engine servers with --enable-lora (rank <= 8, two adapters per batch, three kept)
    behind a router."""
    from servers.router.router_server import RouterOptions, RouterServer

    starters = [
        running_engine_server(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
        for _ in range(2)
    ]
    servers = [await anext(s) for s in starters]
    router = RouterServer(
        RouterOptions(backends=[s.address for s in servers], health_check_interval=0.2, http_port=0)
    )
    await router.start()
    await router.wait_healthy(2)
    yield router, servers
    await router.stop(0)
    for starter in starters:
        with pytest.raises(StopAsyncIteration):
            await anext(starter)


def client_of(lora_fleet: tuple[Any, list[Any]]) -> InferenceClient:
    router, servers = lora_fleet
    return InferenceClient(router.address, [s.address for s in servers])


async def outputs(client: InferenceClient, lora: str = "") -> list[list[int]]:
    results = await asyncio.gather(*(client.generate(p, GREEDY, lora=lora) for p in PROMPTS))
    return [r.token_ids for r in results]


async def test_an_adapter_pushed_in_band_to_two_servers_matches_its_merged_reference(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    client = client_of(lora_fleet)
    adapter = make_adapter(tiny_model_dir, seed=1)
    # In-band: the servers get bytes, never a path the trainer wrote.
    loaded = await client.load_lora("alpha", tensors=adapter[0], config=adapter[1])
    assert {a.version for a in loaded.values()} == {1} and len(loaded) == 2
    assert len({a.sha256 for a in loaded.values()}) == 1  # the same bytes on both
    base, with_adapter = await asyncio.gather(
        asyncio.to_thread(merged_reference, tiny_model_dir, None, PROMPTS),
        asyncio.to_thread(merged_reference, tiny_model_dir, adapter, PROMPTS),
    )
    assert base != with_adapter  # the adapter matters
    assert await outputs(client, "alpha") == with_adapter
    assert await outputs(client) == base  # the base model is untouched
    result = await client.generate(PROMPTS[0], GREEDY, lora="alpha")
    assert result.lora_version == 1
    listed = await client.list_loras()
    assert all([a.name for a in adapters] == ["alpha"] for adapters in listed.values())
    info = await client.server_info()
    assert all(i.capabilities.lora.enabled and i.capabilities.lora.max_lora_rank == 8
               for i in info.values())  # fmt: skip
    assert [a.name for a in (await client.model_info()).lora_adapters] == ["alpha"]
    await client.unload_lora("alpha")
    await client.close()


async def test_two_adapters_and_the_base_model_in_one_concurrent_batch(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    client = client_of(lora_fleet)
    adapters = {
        "a": make_adapter(tiny_model_dir, 2),
        "b": make_adapter(tiny_model_dir, 3, targets=("q_proj", "v_proj", "lm_head")),
    }
    for name, (tensors, config) in adapters.items():
        await client.load_lora(name, tensors=tensors, config=config)
    references = dict(
        zip(
            ["", "a", "b"],
            await asyncio.gather(
                asyncio.to_thread(merged_reference, tiny_model_dir, None, PROMPTS),
                *(
                    asyncio.to_thread(merged_reference, tiny_model_dir, a, PROMPTS)
                    for a in adapters.values()
                ),
            ),
            strict=True,
        )
    )
    assert len({json.dumps(r) for r in references.values()}) == 3
    requests = [(lora, i) for lora in ("", "a", "b") for i in range(len(PROMPTS))] * 2
    results = await asyncio.gather(
        *(client.generate(PROMPTS[i], GREEDY, lora=lora) for lora, i in requests)
    )
    for (lora, i), result in zip(requests, results, strict=True):
        assert result.token_ids == references[lora][i], (lora, i)
    for name in adapters:
        await client.unload_lora(name)
    await client.close()


async def test_an_adapter_replaced_in_place_serves_its_new_version_and_running_requests_keep_theirs(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    client = client_of(lora_fleet)
    first, second = make_adapter(tiny_model_dir, 4), make_adapter(tiny_model_dir, 5)
    await client.load_lora("live", tensors=first[0], config=first[1])
    long = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}
    running = asyncio.ensure_future(client.generate([1, 2, 3], long, lora="live"))
    await running_on_engines(client, 1, running)
    replaced = await client.load_lora("live", tensors=second[0], config=second[1])
    assert {a.version for a in replaced.values()} == {2}
    before = await running
    assert before.lora_version == 1 and len(before.token_ids) == 400
    expected = await asyncio.to_thread(merged_reference, tiny_model_dir, second, PROMPTS)
    assert await outputs(client, "live") == expected
    assert (await client.generate(PROMPTS[0], GREEDY, lora="live")).lora_version == 2
    await client.unload_lora("live")
    await client.close()


async def push(
    address: str, messages: list[cp.LoadLoraAdapterRequest]
) -> cp.LoadLoraAdapterResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        return await stub.LoadLoraAdapter(iter(messages), timeout=60)


async def test_bad_adapters_are_refused_and_the_previous_version_keeps_serving(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    client = client_of(lora_fleet)
    good = make_adapter(tiny_model_dir, 6)
    await client.load_lora("keep", tensors=good[0], config=good[1])
    serving = await outputs(client, "keep")
    address = lora_fleet[1][0].address

    def spec(config: dict[str, Any] | None) -> cp.LoadLoraAdapterRequest:
        text = json.dumps(config) if config is not None else ""
        return cp.LoadLoraAdapterRequest(spec=cp.LoraAdapterSpec(name="keep", config_json=text))

    big_rank = make_adapter(tiny_model_dir, 7, rank=16)
    unknown_target = dict(good[1], target_modules=["q_proj", "x_proj"])
    wrong_shape = {**good[0]}
    name = next(iter(wrong_shape))
    wrong_shape[name] = torch.zeros(8, 64)
    corrupted = lora_push_messages(good[0].items())
    chunk = corrupted[1].chunk
    corrupted[1] = cp.LoadLoraAdapterRequest(
        chunk=cp.WeightChunk(
            name=chunk.name, offset_bytes=0, data=bytes(len(chunk.data)), crc32=chunk.crc32
        )
    )
    cases = [
        ("rank 16 exceeds", [spec(big_rank[1]), *lora_push_messages(big_rank[0].items())],
         grpc.StatusCode.INVALID_ARGUMENT),
        ("x_proj", [spec(unknown_target), *lora_push_messages(good[0].items())],
         grpc.StatusCode.INVALID_ARGUMENT),
        ("shape mismatch", [spec(good[1]), *lora_push_messages(wrong_shape.items())],
         grpc.StatusCode.INVALID_ARGUMENT),
        ("checksum mismatch", [spec(good[1]), *corrupted], grpc.StatusCode.DATA_LOSS),
        ("truncated", [spec(good[1]), *lora_push_messages(good[0].items())[:-1]],
         grpc.StatusCode.INVALID_ARGUMENT),
        ("adapter_config.json", [spec(None), *lora_push_messages(good[0].items())],
         grpc.StatusCode.INVALID_ARGUMENT),
    ]  # fmt: skip
    for why, messages, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(address, messages)
        assert refused.value.code() == code, (why, refused.value.details())
        assert why in (refused.value.details() or ""), (why, refused.value.details())
        assert await outputs(client, "keep") == serving, why
    listed = await client.list_loras()
    assert [a.version for a in listed[address]] == [1]
    await client.unload_lora("keep")
    await client.close()


async def test_an_adapter_reads_back_as_the_stream_that_loads_it_elsewhere(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    """ReadLoraAdapter (what a server catching up reads from its peer): the spec at its
    version, every tensor's SHA-256, chunks that reassemble its bytes; loaded on the other
    server under another name it holds the same bytes. An unknown name is NOT_FOUND."""
    _, servers = lora_fleet
    source, other = servers[0].address, servers[1].address
    tensors, config = make_adapter(tiny_model_dir, 11)
    direct = InferenceClient(source, [source])
    await direct.load_lora("read-me", tensors=tensors, config=config, version=7)
    async with grpc.aio.insecure_channel(source) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        read = [
            m
            async for m in stub.ReadLoraAdapter(
                cp.ReadLoraAdapterRequest(name="read-me", chunk_bytes=1000)
            )
        ]
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            async for _ in stub.ReadLoraAdapter(cp.ReadLoraAdapterRequest(name="nope")):
                pass
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "read-me" in (unknown.value.details() or "")
    spec, manifest = read[0].spec, read[1].manifest
    assert (spec.name, spec.version, json.loads(spec.config_json)["r"]) == ("read-me", 7, 8)
    assert {p.name: p.sha256 for p in manifest.parameters} == {
        name: hashlib.sha256(t.contiguous().numpy().tobytes()).digest()
        for name, t in tensors.items()
    }
    pieces: dict[str, bytes] = {}
    for message in read[2:]:
        chunk = message.chunk
        assert len(chunk.data) <= 1000 and chunk.crc32 == zlib.crc32(chunk.data)
        pieces[chunk.name] = pieces.get(chunk.name, b"") + chunk.data
    assert pieces == {name: t.contiguous().numpy().tobytes() for name, t in tensors.items()}
    # The same messages load it on the other server (as a copy, under another name).
    spec.name, spec.version = "read-copy", 0
    upload = [cp.LoadLoraAdapterRequest(spec=spec)] + [
        cp.LoadLoraAdapterRequest(**{m.WhichOneof("item"): getattr(m, m.WhichOneof("item"))})
        for m in read[1:]
    ]
    async with grpc.aio.insecure_channel(other) as channel:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        copied = await stub.LoadLoraAdapter(iter(upload))
    loaded = (await direct.list_loras())[source]
    assert copied.adapter.sha256 == next(a.sha256 for a in loaded if a.name == "read-me")
    await direct.unload_lora("read-me")
    await direct.close()
    other_client = InferenceClient(other, [other])
    await other_client.unload_lora("read-copy")
    await other_client.close()


async def test_unloaded_or_unknown_adapters_are_not_found_and_the_base_still_serves(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    client = client_of(lora_fleet)
    tensors, config = make_adapter(tiny_model_dir, 8)
    # From a directory on the servers (they share this machine's disk here).
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    loaded = await client.load_lora("from-disk", path=str(tmp_path))
    assert {a.source for a in loaded.values()} == {"path"}
    expected = await asyncio.to_thread(merged_reference, tiny_model_dir, (tensors, config), PROMPTS)
    assert await outputs(client, "from-disk") == expected
    await client.unload_lora("from-disk")
    with pytest.raises(ServerError) as missing:
        await client.generate(PROMPTS[0], GREEDY, lora="from-disk")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert "from-disk" in str(missing.value)
    with pytest.raises(FanOutError):
        await client.unload_lora("from-disk")
    base = await asyncio.to_thread(merged_reference, tiny_model_dir, None, PROMPTS)
    assert await outputs(client) == base
    await client.close()


async def test_vllms_control_loads_an_adapter_and_vllms_inference_generates_with_it(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through vLLM's own gRPC contract (its Rust front end's Control and Inference), on one
    server: LoadLora from a directory, generation by lora_name equal to this stack's and to the
    merged reference, ListLoras, UnloadLora, then NOT_FOUND."""
    from safetensors.torch import save_file

    from skyrl_grpc.vllm_api import control_pb2 as vc
    from skyrl_grpc.vllm_api import control_pb2_grpc, inference_pb2_grpc
    from skyrl_grpc.vllm_api import inference_pb2 as vi

    server = lora_fleet[1][0]
    tensors, config = make_adapter(tiny_model_dir, 9)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))

    def request(prompt: list[int], lora: str) -> vi.GenerateRequest:
        return vi.GenerateRequest(
            token_ids=vi.TokenIds(ids=prompt),
            lora_name=lora,
            stopping=vi.StoppingCriteria(max_new_tokens=GREEDY["max_tokens"], ignore_eos=True),
            response=vi.ResponseOptions(output_token_ids=True),
        )

    async with grpc.aio.insecure_channel(server.address) as channel:
        control = control_pb2_grpc.ControlStub(channel)
        inference = inference_pb2_grpc.InferenceStub(channel)
        loaded = await control.LoadLora(
            vc.LoadLoraRequest(lora_name="vllm-loaded", source_path=str(tmp_path))
        )
        assert loaded.adapter.lora_name == "vllm-loaded"
        assert loaded.adapter.source_path == str(tmp_path)
        expected = await asyncio.to_thread(
            merged_reference, tiny_model_dir, (tensors, config), PROMPTS
        )
        direct = InferenceClient(server.address, [server.address])
        try:
            for prompt, reference in zip(PROMPTS, expected, strict=True):
                answer = await inference.Generate(request(prompt, "vllm-loaded"))
                assert list(answer.outputs.token_ids) == reference
                ours = await direct.generate(prompt, GREEDY, lora="vllm-loaded")
                assert ours.token_ids == reference
        finally:
            await direct.close()
        listed = await control.ListLoras(vc.ListLorasRequest())
        assert "vllm-loaded" in [a.lora_name for a in listed.adapters]
        await control.UnloadLora(vc.UnloadLoraRequest(lora_name="vllm-loaded"))
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await inference.Generate(request(PROMPTS[0], "vllm-loaded"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "vllm-loaded" in (missing.value.details() or "")


async def test_a_server_without_lora_says_how_to_enable_it(engine_server: Any) -> None:
    client = InferenceClient(engine_server.address, [engine_server.address])
    with pytest.raises(ServerError) as refused:
        await client.generate(PROMPTS[0], GREEDY, lora="any")
    # An unknown adapter, as on a server serving LoRA; the message says how to serve them.
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert "--enable-lora" in str(refused.value)
    info = await client.server_info()
    assert not info[engine_server.address].capabilities.lora.enabled
    await client.close()


async def test_the_openai_edge_lists_adapters_and_model_selects_one(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    import httpx

    client = client_of(lora_fleet)
    adapter = make_adapter(tiny_model_dir, 9)
    await client.load_lora("web", tensors=adapter[0], config=adapter[1])
    expected = await asyncio.to_thread(merged_reference, tiny_model_dir, adapter, PROMPTS)
    base_url = f"http://127.0.0.1:{lora_fleet[0].http_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models][1:] == ["web"] and models[1]["parent"] == models[0]["id"]
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        answer = (await http.post("/v1/completions", json={**body, "model": "web"})).json()
        assert answer["choices"][0]["token_ids"] == expected[0]
        assert answer["model"] == "web"
        missing = await http.post("/v1/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404
    await client.unload_lora("web")
    await client.close()


async def test_the_lora_demo_learns_by_pushing_only_its_adapter(
    lora_fleet: tuple[Any, list[Any]], tiny_model_dir: Path
) -> None:
    from trainer_client.demo import (
        ADAPTER_NAME,
        LORA_LEARNING_RATE,
        TARGET_STRIDE,
        DemoConfig,
        run_rl_loop,
    )

    client = client_of(lora_fleet)
    # 16 steps: when the rise starts depends on the engines' sampling stream (what ran on
    # them before); it was under way by step 10 in some runs, not yet in others.
    short = dict(
        steps=16, batch_size=16, max_tokens=16, seed=0, progress=False, lora=True,
        learning_rate=LORA_LEARNING_RATE,
    )  # fmt: skip
    versions_before = await client.weight_versions()
    learned = await run_rl_loop(client, tiny_model_dir, DemoConfig(**short, sync=True))  # type: ignore[arg-type]
    control = await run_rl_loop(client, tiny_model_dir, DemoConfig(**short, sync=False))  # type: ignore[arg-type]
    first, last = learned.summary()
    assert last > first + 0.2, learned.rewards
    control_first, control_last = control.summary()
    assert control_last < 1 / TARGET_STRIDE + 0.05, control.rewards
    assert await client.weight_versions() == versions_before  # the base weights never moved
    await client.unload_lora(ADAPTER_NAME)
    await client.close()
