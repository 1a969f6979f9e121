"""The SkyRL drop-in hands routed experts (R3) over as SkyRL's generator takes them: asked for
from each prompt's ``routed_experts_prompt_starts``, returned as ``rollout_expert_indices``
that SkyRL's own ``RoutedExpertTrace`` accepts turn after turn. The source is a stand-in
server (this CPU build of vLLM cannot capture experts), packing the arrays as the engine's
converter packs vLLM's; the client, its batched calls and SkyRL's trace run for real."""

from __future__ import annotations

import numpy as np
from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInput
from skyrl.backends.skyrl_train.utils.routed_experts import RoutedExpertTrace

from tests.helpers.fake_backend import FakeBackend
from trainer_client.skyrl_engine import SkyRLInferenceEngine

LAYERS, PER_TOKEN, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B's shape
OUTPUT_TOKENS = 4


async def test_the_dropin_returns_each_prompts_experts_from_its_start_as_skyrl_takes_them() -> None:
    made: list[np.ndarray] = []

    def experts_of(rows: int) -> np.ndarray:
        """Distinct ids per token and layer, numbered so each array tells its rows apart."""
        rng = np.random.default_rng(len(made))
        made.append(np.argsort(rng.random((rows, LAYERS, EXPERTS)), axis=2)[:, :, :PER_TOKEN])
        return made[-1]

    backend = await FakeBackend("fake-moe", delay=0.001).start()
    backend.servicer.routed_experts = experts_of
    engine = SkyRLInferenceEngine(backend.address, [], direct=False)
    traces = [RoutedExpertTrace(), RoutedExpertTrace()]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    try:
        for _turn in range(2):
            made.clear()
            starts = [trace.prompt_start for trace in traces]
            output = await engine.generate(
                InferenceEngineInput(
                    prompt_token_ids=prompts,
                    sampling_params={"max_tokens": OUTPUT_TOKENS},
                    routed_experts_prompt_starts=starts,
                )
            )
            indices = output["rollout_expert_indices"]
            assert indices is not None and len(indices) == len(prompts)
            for trace, prompt, response, start, array in zip(
                traces, prompts, output["response_ids"], starts, indices, strict=True
            ):
                # the prompt's rows from its start, then the output's but the last
                assert array.shape == (len(prompt) - start + OUTPUT_TOKENS - 1, LAYERS, PER_TOKEN)
                assert any(np.array_equal(array, m) for m in made)
                trace.record_generation(
                    prompt_token_count=len(prompt),
                    generated_token_count=len(response),
                    routed_experts=array,
                )
            # the next turn's prompt: this one, its answer and a new user message
            answers = output["response_ids"]
            prompts = [p + list(r) + [9, 9] for p, r in zip(prompts, answers, strict=True)]
        assert [trace.prompt_start for trace in traces] == [len(p) - 2 - 1 for p in prompts]
        assert len(backend.servicer.asked_experts) == 4 and all(backend.servicer.asked_experts)
        # Without starts, nothing is asked and SkyRL reads None.
        backend.servicer.asked_experts.clear()
        plain = await engine.generate(
            InferenceEngineInput(prompt_token_ids=prompts, sampling_params={"max_tokens": 2})
        )
        assert plain["rollout_expert_indices"] is None
        assert backend.servicer.asked_experts and not any(backend.servicer.asked_experts)
    finally:
        await engine.client.close()
        await backend.stop()
