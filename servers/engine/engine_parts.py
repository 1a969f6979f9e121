"""The one place that builds what the servicers use once the engine has started: the vLLM
adapter (``vllm_engine``), the domain around it (the serving weights, LoRA adapters, live
sessions) and the request rules' inputs (model limits, chat parsers). Each part gets the
others' calls as plain callables; nothing is patched on from outside.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .adapters import (
    ZERO_ADAPTER_ID,
    AdapterLimits,
    AdapterManager,
    EngineAdapterCalls,
    ModelShapes,
    write_zero_adapter,
)
from .chat_parsing import ChatParsers
from .descriptions import ModelDescription, ServerDescription
from .live_sessions import LiveSessions
from .options import EngineOptions, RequestLimits
from .tokenizer_calls import TokenizerCalls
from .validate import ModelLimits
from .vllm_engine import VllmEngine
from .weights.serving import ServingWeights


@dataclass
class EngineParts:
    """A started engine and everything built around it."""

    engine: VllmEngine
    # Text to ids and back, chat templates.
    tokenizer: TokenizerCalls
    weights: ServingWeights
    adapters: AdapterManager
    sessions: LiveSessions
    limits: ModelLimits
    # Tool calls and reasoning in chat outputs, by vLLM's parsers named in the options.
    chat_parsers: ChatParsers
    # Tells status watchers (placers) that what ServerStatus reports changed.
    status_changed: Callable[[], None]

    @classmethod
    async def start(
        cls,
        options: EngineOptions,
        limits: RequestLimits,
        status_changed: Callable[[], None],
        errors: Path | None = None,
    ) -> EngineParts:
        """Starts vLLM (``VllmEngine.start``) and builds the parts around it."""
        engine = await VllmEngine.start(options, limits, errors)
        try:
            return await cls._around(engine, options, limits, status_changed)
        except BaseException:
            await engine.shutdown()
            raise

    @classmethod
    async def _around(
        cls,
        engine: VllmEngine,
        options: EngineOptions,
        limits: RequestLimits,
        status_changed: Callable[[], None],
    ) -> EngineParts:
        shapes = None
        if options.enable_lora:
            config = json.loads((Path(engine.model_path) / "config.json").read_text())
            shapes = ModelShapes.from_config(config)
        adapter_limits = (
            AdapterLimits(
                enabled=True,
                max_loras=options.max_loras,
                max_lora_rank=options.max_lora_rank,
                max_cpu_loras=options.max_cpu_loras or options.max_loras,
            )
            if options.enable_lora
            else AdapterLimits(enabled=False)
        )
        adapters = AdapterManager(
            adapter_limits, shapes, EngineAdapterCalls(engine.add_lora, engine.remove_lora)
        )
        if options.enable_lora and engine.device == "cpu":
            directory = adapters.staging_dir("base")
            await asyncio.to_thread(write_zero_adapter, directory, adapters.shapes)
            await engine.pin_base_adapter(ZERO_ADAPTER_ID, directory)
        return cls(
            engine=engine,
            tokenizer=engine.tokenizer_calls,
            weights=ServingWeights(engine, options, status_changed),
            adapters=adapters,
            sessions=LiveSessions(options.session_idle_seconds),
            limits=ModelLimits(
                vocab_size=engine.vocab_size,
                max_model_len=engine.max_model_len,
                max_logprobs=min(engine.max_logprobs, limits.max_logprobs),
                max_prompt_tokens=limits.max_prompt_tokens or 0,
                max_n=limits.max_n,
                max_request_id_bytes=limits.max_request_id_bytes,
            ),
            chat_parsers=ChatParsers(
                engine.tokenizer,
                engine.served_model_name,
                tool_call_parser=options.tool_call_parser,
                reasoning_parser=options.reasoning_parser,
                enable_auto_tool_choice=options.enable_auto_tool_choice,
            ),
            status_changed=status_changed,
        )

    def describe_model(self) -> ModelDescription:
        engine = self.engine
        tokenizer = engine.tokenizer
        return ModelDescription(
            served_model_name=engine.served_model_name,
            vocab_size=self.limits.vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=self.tokenizer.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id,
            max_context_length=self.limits.max_model_len,
            has_chat_template=bool(tokenizer.chat_template),
            lora_adapters=self.adapters.serving(),
        )

    def describe_server(self) -> ServerDescription:
        engine = self.engine
        return ServerDescription(
            world_size=engine.world_size,
            weight_group_ranks=engine.world_size // engine.tensor_parallel_size,
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            data_parallel_size=engine.data_parallel_size,
            sleep_supported=engine.sleep_supported,
            weight_transfer_backends=engine.weight_transfer_backends,
            prefix_caching=engine.prefix_caching,
            lora=self.adapters.limits,
            weight_version=self.weights.version,
            engine="vllm",
            engine_version=engine.engine_version,
            served_model_name=engine.served_model_name,
            device=engine.device,
        )

    async def shutdown(self) -> None:
        await self.weights.close()
        self.adapters.close()
        await self.engine.shutdown()
