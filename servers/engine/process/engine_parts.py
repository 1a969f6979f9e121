"""The one place that builds the engine's parts once it has started: the vLLM adapter
(``vllm_engine``), the domain around it (the serving weights, LoRA adapters, live sessions,
pausing) and the request rules' inputs (model limits, chat parsers), and from them each
servicer's parts (``DataPlaneParts``, ``ControlPlaneParts``, the status ServerStatus streams)
and what a catch-up uses (``CatchUpParts``). Each part gets the others' calls as plain
callables, status announcements among them; nothing is patched on from outside.
(``engine_server`` runs the process around them: it builds nothing of its own.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import skyrl_grpc
from servers.engine.domain.chat_parsing import ChatParsers
from servers.engine.domain.descriptions import ModelDescription, ServerDescription, ServingStatus
from servers.engine.domain.live_sessions import LiveSessions
from servers.engine.domain.lora_adapters import (
    ZERO_ADAPTER_ID,
    AdapterLimits,
    AdapterManager,
    EngineAdapterCalls,
    ModelShapes,
    write_zero_adapter,
)
from servers.engine.domain.pausing import Pausing
from servers.engine.domain.weights.serving import ServingWeights, WeightRules
from servers.engine.domain.weights.transaction import PhaseObserver
from servers.engine.options import EngineOptions, RequestLimits
from servers.engine.peers.catch_up import CatchUpParts
from servers.engine.service.control_plane import ControlPlaneParts
from servers.engine.service.data_plane import DataPlaneParts
from servers.engine.service.validate import ModelLimits
from servers.engine.vllm_adapter.chat_parser_calls import VllmChatParsers
from servers.engine.vllm_adapter.tokenizer_calls import TokenizerCalls
from servers.engine.vllm_adapter.vllm_engine import VllmEngine


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
    pausing: Pausing
    # Each servicer's parts, and a catch-up's: exactly what each uses, built below.
    data_plane: DataPlaneParts = field(init=False)
    control_plane: ControlPlaneParts = field(init=False)
    catch_up: CatchUpParts = field(init=False)

    def __post_init__(self) -> None:
        self.data_plane = DataPlaneParts(
            engine=self.engine,
            tokenizer=self.tokenizer,
            limits=self.limits,
            sessions=self.sessions,
            chat_parsers=self.chat_parsers,
            adapters=self.adapters,
            weights=self.weights,
            describe_model=self.describe_model,
        )
        self.control_plane = ControlPlaneParts(
            pausing=self.pausing,
            engine=self.engine,
            weights=self.weights,
            adapters=self.adapters,
            describe_server=self.describe_server,
        )
        self.catch_up = CatchUpParts(weights=self.weights, adapters=self.adapters)

    @classmethod
    async def start(
        cls,
        options: EngineOptions,
        limits: RequestLimits,
        status_changed: Callable[[], None],
        errors: Path | None = None,
        on_phase: PhaseObserver | None = None,
    ) -> EngineParts:
        """Starts vLLM (``VllmEngine.start``) and builds the parts around it; ``on_phase``
        hears each weight update phase end (the server's metrics)."""
        engine = await VllmEngine.start(options, limits, errors)
        try:
            return await cls._around(engine, options, limits, status_changed, on_phase)
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
        on_phase: PhaseObserver | None = None,
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
        sessions = LiveSessions(options.session_idle_seconds, on_change=status_changed)
        weights = ServingWeights(
            engine,
            WeightRules(
                options.weight_stage_batch_bytes,
                options.weight_update_lease_seconds,
                options.allow_non_finite_weights,
                options.weight_staging,
            ),
            status_changed,
            on_phase,
        )
        parsers = ChatParsers(
            VllmChatParsers(
                engine.tokenizer,
                engine.served_model_name,
                tool_call_parser=options.tool_call_parser,
                reasoning_parser=options.reasoning_parser,
                enable_auto_tool_choice=options.enable_auto_tool_choice,
            )
        )
        model_limits = ModelLimits(
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            max_logprobs=min(engine.max_logprobs, limits.max_logprobs),
            max_prompt_tokens=limits.max_prompt_tokens or 0,
            max_n=limits.max_n,
            max_request_id_bytes=limits.max_request_id_bytes,
            routed_experts=options.enable_return_routed_experts,
        )
        return cls(
            engine=engine,
            tokenizer=engine.tokenizer_calls,
            weights=weights,
            adapters=adapters,
            sessions=sessions,
            limits=model_limits,
            chat_parsers=parsers,
            pausing=Pausing(engine.pause, engine.resume, engine.is_paused, status_changed),
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
            server_version=skyrl_grpc.__version__,
            open_update=self.weights.updates.open,
            rollback_version=self.weights.updates.rollback_version,
            group=self.weights.updates.group,
            routed_experts=self.limits.routed_experts,
        )

    def serving_status(self) -> ServingStatus:
        """What ServerStatus streams to placers, now."""
        engine = self.engine
        load = engine.load()
        return ServingStatus(
            paused=engine.paused,
            weight_version=self.weights.version,
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            prompt_tokens=engine.prompt_tokens,
            cached_prompt_tokens=engine.cached_prompt_tokens,
            sessions=self.sessions.snapshot(),
            adapters=tuple(sorted(a.name for a in self.adapters.serving())),
            recent_updates=self.weights.recent.records(),
        )

    async def shutdown(self) -> None:
        await self.weights.close()
        self.adapters.close()
        await self.engine.shutdown()
