"""SkyRL's own SkyRLGymGenerator (package ``skyrl`` 0.4.0, unmodified) running its multi-turn
agent loop on this stack through ``trainer_client.skyrl_engine``, against two real engine
servers behind a router (tiny model)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.train.config import GeneratorConfig, SamplingParams, SkyRLGymConfig
from skyrl.train.generators.base import TrajectoryID
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl_gym import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_grpc.tensor_bytes import sha256_of
from tests.helpers.waits import failing_while_paused, running_on_engines
from trainer_client.results import GenerationResult
from trainer_client.skyrl_engine import (
    NamedTensorsRequest,
    SkyRLInferenceEngine,
    sampling_from_skyrl,
)

pytestmark = pytest.mark.engine
TURNS = 3


class CountdownEnv(BaseTextEnv):  # type: ignore[misc]
    """Three turns; each answer earns its length in tokens-ish characters, capped at 1."""

    def __init__(self, env_config: Any = None, extras: Any = None) -> None:
        super().__init__()
        self.turn = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turn += 1
        done = self.turn >= TURNS
        return BaseTextEnvStepOutput(
            observations=[] if done else [{"role": "user", "content": f"turn {self.turn}: go on"}],
            reward=1.0 if done else 0.0,
            done=done,
            metadata={},
        )


register(id="countdown", entry_point=CountdownEnv)


class Recorded:
    """What the servers answered, per session (read where the adapter receives it), and
    which servers each session's turns ran on (read at the servers)."""

    def __init__(self, engine: SkyRLInferenceEngine, servers: list[Any]) -> None:
        self.outputs: dict[str, list[GenerationResult]] = defaultdict(list)
        self.servers_of: dict[str, set[str]] = defaultdict(set)
        self.finished: list[str] = []
        # The drop-in sends every generate as one batched call (generate_batch).
        generate_batch, finish = engine.client.generate_batch, engine.client.finish_session

        async def recording_generate_batch(
            prompts: Any, sampling: Any = None, **kw: Any
        ) -> list[GenerationResult]:
            results = await generate_batch(prompts, sampling, **kw)
            for session, result in zip(kw["session_ids"], results, strict=True):
                self.outputs[session].append(result)
            return results

        async def recording_finish(session: str) -> bool:
            self.finished.append(session)
            return await finish(session)

        engine.client.generate_batch = recording_generate_batch  # type: ignore[method-assign]
        engine.client.finish_session = recording_finish  # type: ignore[method-assign,assignment]
        for server in servers:
            sessions = server.state.started.sessions
            touch = sessions.touch

            def spy(session: str, _touch: Any = touch, _address: str = server.address) -> bool:
                self.servers_of[session].add(_address)
                return bool(_touch(session))

            sessions.touch = spy


def make_generator(engine: SkyRLInferenceEngine, tiny_model_dir: Path) -> SkyRLGymGenerator:
    from transformers import AutoTokenizer

    config = GeneratorConfig(
        max_turns=TURNS,
        batched=False,
        use_conversation_multi_turn=True,
        max_input_length=400,
        sampling_params=SamplingParams(max_generate_length=8, temperature=1.0, logprobs=0),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return SkyRLGymGenerator(config, SkyRLGymConfig(max_env_workers=0), engine, tokenizer)


def batch(count: int, tag: str) -> dict[str, Any]:
    return {
        "prompts": [[{"role": "user", "content": f"task {i}"}] for i in range(count)],
        "env_classes": ["countdown"] * count,
        "env_extras": [{} for _ in range(count)],
        "sampling_params": get_vllm_sampling_params(
            SamplingParams(max_generate_length=8, temperature=1.0, logprobs=0)
        ),
        "trajectory_ids": [TrajectoryID(f"{tag}{i}", 0) for i in range(count)],
    }


def test_skyrl_sampling_keys_map_and_unknown_ones_are_named() -> None:
    fields, keep = sampling_from_skyrl(
        get_vllm_sampling_params(SamplingParams(max_generate_length=8, stop=["</a>"]))
    )
    assert fields["max_tokens"] == 8 and fields["stop_strings"] == ["</a>"] and keep
    assert "top_k" not in fields  # SkyRL's -1: disabled
    with pytest.raises(ValueError, match="best_of"):
        sampling_from_skyrl({"best_of": 2})


async def test_skyrl_gym_generator_runs_multi_turn_sessions_on_the_stack(
    two_server_router: Any, engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> None:
    servers = [engine_server, second_engine_server]
    engine = SkyRLInferenceEngine(two_server_router.address, [s.address for s in servers])
    recorded = Recorded(engine, servers)
    generator = make_generator(engine, tiny_model_dir)
    count = 6
    output = await generator.generate(batch(count, "dropin"), disable_tqdm=True)
    sessions = [f"dropin{i}_0" for i in range(count)]
    assert output["rewards"] and all(sum(r) == 1.0 for r in output["rewards"])
    assert sorted(recorded.finished) == sorted(sessions)
    assert {len(recorded.outputs[s]) for s in sessions} == {TURNS}
    for i, session in enumerate(sessions):
        assert len(recorded.servers_of[session]) == 1, recorded.servers_of[session]
        # The tokens SkyRL trains on (loss mask 1) are what the servers generated, in order,
        # with the logprobs they reported.
        mask = output["loss_masks"][i]
        trained = [t for t, m in zip(output["response_ids"][i], mask, strict=True) if m]
        generated = [t for r in recorded.outputs[session] for t in r.token_ids]
        assert trained == generated
        logprobs = output["rollout_logprobs"]
        assert logprobs is not None
        trained_logprobs = [lp for lp, m in zip(logprobs[i], mask, strict=True) if m]
        assert trained_logprobs == [
            lp for r in recorded.outputs[session] for lp in r.logprobs or []
        ]
    # Two servers, six sessions: placement used both.
    assert len(set().union(*(recorded.servers_of[s] for s in sessions))) == 2


async def test_skyrl_generator_survives_pause_weight_push_and_resume(
    two_server_router: Any, engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> None:
    servers = [engine_server, second_engine_server]
    engine = SkyRLInferenceEngine(
        two_server_router.address, [s.address for s in servers], compress_patches=True
    )
    generator = make_generator(engine, tiny_model_dir)
    rollouts = asyncio.ensure_future(generator.generate(batch(8, "paused"), disable_tqdm=True))
    await running_on_engines(engine.client, 1, rollouts)
    await engine.pause_generation()
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    before = await engine.refresh_weight_version()
    await engine.update_named_weights(NamedTensorsRequest.of(original.items()))
    await engine.resume_generation()
    output = await asyncio.wait_for(rollouts, 300)
    assert len(output["response_ids"]) == 8 and all(output["response_ids"])
    assert all(sum(r) == 1.0 for r in output["rewards"])
    versions = await engine.client.weight_versions()
    assert versions.consistent
    # The adapter's version is what the servers committed, not a count of its own calls.
    assert engine.weight_version == versions.newest == before + 1
    # The next sync sends what changed, compressed: 50 elements would be 400 bytes plain.
    name = sorted(original)[0]
    stepped = dict(original)
    stepped[name] = original[name].clone()
    stepped[name].view(-1)[:50] += 1e-3
    await engine.update_named_weights(NamedTensorsRequest.of(stepped.items()))
    assert all(0 < sent < 400 for sent in engine.client.last_push_bytes.values())
    served = await engine.client.weight_checksums([name])
    assert all(checksums[name] == sha256_of(stepped[name]) for checksums in served.values())
    await engine.update_named_weights(NamedTensorsRequest.of(original.items()))


async def test_one_failing_prompt_cancels_the_rest_of_a_skyrl_batch(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    servers = [engine_server.address, second_engine_server.address]
    engine = SkyRLInferenceEngine(two_server_router.address, servers)
    batch = {
        "prompt_token_ids": [[1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 99999]],
        "sampling_params": {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0},
    }
    error = await failing_while_paused(engine.client, engine.generate(batch))
    assert "INVALID_ARGUMENT" in str(error)


async def test_http_calls_share_a_connection_pool_and_raise_the_servers_errors(
    http_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    import httpx

    from trainer_client.skyrl_engine import HttpError

    servers = [engine_server.address, second_engine_server.address]
    engine = SkyRLInferenceEngine(
        http_router.address, servers, http_url=f"http://127.0.0.1:{http_router.http_port}"
    )
    opened: list[httpx.AsyncClient] = []
    real = httpx.AsyncClient

    def counting(*args: Any, **kwargs: Any) -> httpx.AsyncClient:
        opened.append(real(*args, **kwargs))
        return opened[-1]

    httpx.AsyncClient = counting  # type: ignore[misc,assignment]
    try:
        for turn in range(3):
            answer = await engine.chat_completion(
                {"json": {"model": "", "messages": [{"role": "user", "content": f"turn {turn}"}],
                          "max_tokens": 4}}
            )  # fmt: skip
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        with pytest.raises(HttpError) as raised:
            await engine.completion({"json": {"model": "", "prompt": [1, 99999]}})
    finally:
        httpx.AsyncClient = real  # type: ignore[misc]
    assert len(opened) == 1  # one pool for every call of this event loop
    assert raised.value.status == 400 and "99999" in raised.value.message
    await engine.teardown()
    assert opened[0].is_closed  # closed with the client's other per-loop resources


async def test_skyrl_0_4_surface_samples_pauses_and_refuses_what_it_cannot_do(
    two_server_router: Any, engine_server: Any, second_engine_server: Any
) -> None:
    from trainer_client.exceptions import NotFound

    servers = [engine_server.address, second_engine_server.address]
    engine = SkyRLInferenceEngine(two_server_router.address, servers, model_name="tiny")
    # Tinker-style sample: n completions of a token prompt, with logprobs.
    sampled = await engine.sample(
        {
            "json": {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 4, 8]}]},
                "num_samples": 2,
                "sampling_params": {"max_tokens": 4, "temperature": 1.0},
            }
        }
    )
    assert [len(s["tokens"]) == len(s["logprobs"]) for s in sampled["sequences"]] == [True] * 2
    with pytest.raises(ValueError, match="best_of"):
        await engine.sample({"json": {"prompt": {"chunks": []}, "sampling_params": {"best_of": 2}}})
    # pause(mode) as SkyRL's client has it; the default KEEP of pause_generation.
    assert set(await engine.pause("wait")) == set(servers)
    assert set(await engine.resume()) == set(servers)
    assert set(await engine.pause_generation()) == set(servers)
    assert await engine.client.is_paused() == dict.fromkeys(servers, True)
    await engine.resume_generation()
    # An unknown sampling key, a LoRA adapter never loaded, weights without tensors.
    with pytest.raises(ValueError, match="best_of"):
        await engine.generate({"prompt_token_ids": [[1, 2]], "sampling_params": {"best_of": 2}})
    with pytest.raises(NotFound, match="no LoRA adapter named 'never-loaded'"):
        await engine.generate(
            {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 2}},
            model="never-loaded",
        )
    with pytest.raises(NotImplementedError, match="carries no tensors"):
        await engine.update_named_weights({"names": ["w"], "dtype_names": ["bfloat16"]})
    assert await engine.get_world_size() == (2, 1)
    await engine.teardown()


async def test_a_skyrl_batch_on_a_paused_fleet_behind_a_fail_fast_router_is_a_clear_error(
    engine_server: Any, second_engine_server: Any
) -> None:
    from servers.router.proxy import ProxyOptions
    from tests.conftest import running_router
    from tests.helpers.waits import engines_idle, until

    servers = [engine_server.address, second_engine_server.address]
    async for router in running_router(servers, proxy=ProxyOptions(fail_when_paused=True)):
        engine = SkyRLInferenceEngine(router.address, servers, direct=False)
        await engine.pause_generation()
        try:
            await until(lambda pool=router.pool: all(b.paused for b in pool.backends))  # type: ignore[misc]
            batch = {"prompt_token_ids": [[1, 2, 3], [1, 4]], "sampling_params": {"max_tokens": 4}}
            with pytest.raises(Exception, match="--fail-when-paused") as raised:
                await asyncio.wait_for(engine.generate(batch), 30)
            assert "UNAVAILABLE" in str(raised.value)
            await until(lambda c=engine.client: engines_idle(c), 10, "nothing left running")  # type: ignore[misc]
        finally:
            await engine.resume_generation()
            await engine.teardown()
