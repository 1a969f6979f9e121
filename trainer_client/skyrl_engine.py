"""SkyRL's ``InferenceEngineInterface`` on this stack: SkyRL's generators run unchanged.

``SkyRLInferenceEngine(router, servers)`` stands where SkyRL's ``RemoteInferenceClient``
stands: ``generate`` goes through ``InferenceClient`` (gRPC streams through the router, a
session per trajectory, aborted samples resubmitted), control calls fan out to every server,
and ``update_named_weights`` pushes tensors with this stack's fleet-wide weight transaction
(in-band by default). ``chat_completion`` / ``completion`` go to the router's OpenAI HTTP edge
(``http_url``). Picklable like the client: only addresses and settings are kept.

Needs the ``skyrl`` extra (see the README: ``skyrl`` and ``skyrl-gym`` are installed without
their dependencies, whose pins would replace the transformers vLLM runs on).

What maps and what does not:
- Sampling dicts with SkyRL's (vLLM's) keys map onto ``SamplingParams``; an unknown key is an
  error naming it. ``n`` must be 1 (SkyRL samples repetitions as separate trajectories).
- ``cache_salt`` is accepted and not needed: servers salt the prefix cache with the weight
  version themselves, so no request reuses blocks computed under other weights.
- Weight sync: SkyRL's NCCL broadcast and CUDA-IPC requests carry only names, dtypes and
  shapes (the tensors travel on their own channel), which does not exist on CPU. Pass the
  tensors instead (``NamedTensorsRequest``, or ``(name, tensor)`` pairs); they go in-band
  (CRC-checked chunks, only what changed), or over this stack's collective
  (``transport="collective"`` after ``client.init_weight_transfer``).
  ``init_weight_update_communicator`` records nothing and says so in the log.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import typing_extensions

# skyrl 0.3.0's pydantic models use typing.TypedDict, which pydantic refuses on Python < 3.12
# ("Please use typing_extensions.TypedDict"): bind the compatible one before skyrl is imported.
# The one place this is done.
typing.TypedDict = typing_extensions.TypedDict

from skyrl.backends.skyrl_train.inference_servers.base import (  # noqa: E402
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)
from skyrl.backends.skyrl_train.weight_sync.base import WeightUpdateRequest  # noqa: E402

from skyrl_grpc.concurrency import all_or_cancel  # noqa: E402

from .client import InferenceClient  # noqa: E402
from .exceptions import InferenceError  # noqa: E402
from .results import GenerationResult  # noqa: E402
from .weight_updates import WeightTransport  # noqa: E402

log = logging.getLogger(__name__)


class HttpError(InferenceError):
    """The router's OpenAI edge answered an error status; the message is the server's."""

    def __init__(self, path: str, status: int, message: str) -> None:
        super().__init__(f"POST {path}: HTTP {status}: {message}")
        self.path = path
        self.status = status
        self.message = message


def _error_message(response: Any) -> str:
    """The message of an OpenAI error body, or the body as text."""
    try:
        body = response.json()
        return str(body["error"]["message"])
    except Exception:
        return str(response.text)[:2000]


# SkyRL sampling key -> SamplingParams field (None: handled here, not by the engine).
SAMPLING_KEYS: dict[str, str | None] = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
    "stop": "stop_strings",
    "stop_token_ids": "stop_token_ids",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "include_stop_str_in_output": None,
    "n": None,
}


def sampling_from_skyrl(params: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """SamplingParams fields for a SkyRL sampling dict, and whether the caller wants the stop
    string kept in the text. Raises ValueError naming keys that have no meaning here."""
    params = dict(params or {})
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"sampling params {unknown} are not supported by skyrl-grpc; supported: "
            f"{', '.join(sorted(SAMPLING_KEYS))}"
        )
    if params.get("n", 1) not in (1, None):
        raise ValueError("n > 1 is not supported: sample repetitions as separate trajectories")
    fields: dict[str, Any] = {}
    for key, value in params.items():
        target = SAMPLING_KEYS[key]
        if target is None or value is None:
            continue
        if key == "top_k" and value in (-1, 0):
            continue  # disabled, as SkyRL's default -1 means
        if key == "stop" and isinstance(value, str):
            value = [value]
        fields[target] = list(value) if isinstance(value, (list, tuple)) else value
    return fields, bool(params.get("include_stop_str_in_output", False))


@dataclass
class NamedTensorsRequest(WeightUpdateRequest):  # type: ignore[misc]
    """A SkyRL weight update that carries its tensors (CPU, or any trainer that has them)."""

    tensors: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, Any]]) -> NamedTensorsRequest:
        pairs = list(named_tensors)
        return cls(
            names=[n for n, _ in pairs],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in pairs],
            shapes=[list(t.shape) for _, t in pairs],
            tensors=[t for _, t in pairs],
        )


class SkyRLInferenceEngine(InferenceEngineInterface):  # type: ignore[misc]
    """This stack as SkyRL's inference engine. ``servers``: every engine server (control
    calls fan out to them); ``http_url``: the router's OpenAI edge (``--http-port``), for
    ``chat_completion`` / ``completion``; ``transport``: how ``update_named_weights`` sends."""

    def __init__(
        self,
        router: str,
        servers: Sequence[str],
        *,
        model_name: str = "",
        http_url: str | None = None,
        transport: WeightTransport = "grpc",
        **client_settings: Any,
    ) -> None:
        self.client = InferenceClient(router, servers, **client_settings)
        self._model_name = model_name
        self.http_url = http_url
        self.transport = transport
        # The version the fleet committed at the last weight sync through this adapter (0:
        # none yet); ``refresh_weight_version`` reads what the servers serve. SkyRL's
        # generator salts its requests with it (the servers salt their caches themselves).
        self._weight_version = 0

    # -- identity ----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def increment_weight_version(self) -> None:
        """SkyRL calls this after a weight sync; the version comes from the servers here
        (``update_named_weights`` records what they committed), so it changes nothing."""

    async def refresh_weight_version(self) -> int:
        """The newest version the servers serve, read from them and kept."""
        self._weight_version = (await self.client.weight_versions()).newest
        return self._weight_version

    def get_endpoint_url(self) -> str:
        return self.http_url or self.client.config.router

    async def get_world_size(self) -> tuple[int, int]:
        total = await self.client.world_size()
        return total, total // max(len(self.client.config.servers), 1)

    # -- data plane --------------------------------------------------------------------------

    async def generate(
        self, input_batch: InferenceEngineInput, model: str | None = None
    ) -> InferenceEngineOutput:
        if model and self._model_name and model != self._model_name:
            raise ValueError(f"model {model!r}: this stack serves {self._model_name!r}")
        sampling, keep_stop = sampling_from_skyrl(input_batch.get("sampling_params"))
        prompts = input_batch.get("prompt_token_ids")
        if prompts is None:
            conversations = input_batch.get("prompts")
            if conversations is None:
                raise ValueError("pass prompt_token_ids or prompts")
            prompts = await all_or_cancel(self.client.tokenize(messages=c) for c in conversations)
        sessions: Sequence[Hashable | None] = input_batch.get("session_ids") or [None] * len(
            prompts
        )
        # One failure cancels the rest of the batch (their requests are aborted on the servers).
        results: list[GenerationResult] = await all_or_cancel(
            self.client.generate(
                prompt,
                sampling,
                session_id=None if session is None else str(session),
                include_text=True,
            )
            for prompt, session in zip(prompts, sessions, strict=True)
        )
        with_logprobs = sampling.get("logprobs") is not None
        return InferenceEngineOutput(
            responses=[(r.text or "") + (r.stop_text or "" if keep_stop else "") for r in results],
            response_ids=[list(r.token_ids) for r in results],
            stop_reasons=[r.finish_reason.value for r in results],  # vLLM's names, as SkyRL's
            response_logprobs=[list(r.logprobs or []) for r in results] if with_logprobs else None,
            prompt_logprobs=None,
            rollout_expert_indices=None,
        )

    async def finish_session(self, session_id: str) -> None:
        await self.client.finish_session(str(session_id))

    async def _http(self, path: str, request_payload: dict[str, Any]) -> dict[str, Any]:
        if self.http_url is None:
            raise RuntimeError(
                "no OpenAI HTTP endpoint: start the router with --http-port and pass http_url"
            )
        import httpx

        # One connection pool per event loop, kept across calls (an agent makes one call per
        # turn), closed with its loop.
        http = self.client.connections.loop_local(
            "skyrl-httpx", lambda: httpx.AsyncClient(timeout=None), lambda c: c.aclose()
        )
        response = await http.post(
            f"{self.http_url.rstrip('/')}{path}",
            json=request_payload.get("json", {}),
            headers=request_payload.get("headers") or {},
        )
        if response.status_code >= 400:
            raise HttpError(path, response.status_code, _error_message(response))
        answer: dict[str, Any] = response.json()
        return answer

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        return await self._http("/v1/chat/completions", request_payload)

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        return await self._http("/v1/completions", request_payload)

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        body = request_payload.get("json", {})
        ids = await self.client.tokenize(messages=body.get("messages", []))
        return {"prompt_token_ids": ids}

    # -- control plane -----------------------------------------------------------------------

    async def pause_generation(self, clear_cache: bool = False) -> None:
        # SkyRL's pause freezes in-flight requests and resumes them in place: KEEP.
        await self.client.pause("keep", clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self.client.resume()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self.client.reset_prefix_cache()

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        await self.client.sleep(int(kwargs.get("level", args[0] if args else 1)))

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        await self.client.wake_up(tuple(kwargs.get("tags") or ()))

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        log.info(
            "skyrl-grpc: %s is not used; weights travel %s (update_named_weights needs tensors)",
            type(init_info).__name__,
            "in-band" if self.transport == "grpc" else "over this stack's collective",
        )

    async def update_named_weights(self, request: Any) -> None:
        """Pushes a ``NamedTensorsRequest`` (or ``(name, tensor)`` pairs) to every server as one
        transaction, then bumps the weight version."""
        if isinstance(request, NamedTensorsRequest):
            pairs = list(zip(request.names, request.tensors, strict=True))
        elif isinstance(request, WeightUpdateRequest):
            raise NotImplementedError(
                f"{type(request).__name__} carries no tensors (they travel over NCCL or CUDA "
                "IPC, which this stack does not receive): pass NamedTensorsRequest.of(...)"
            )
        else:
            pairs = list(request)
        committed = await self.client.update_weights(pairs, transport=self.transport)
        self._weight_version = max(int(r.weight_version) for r in committed.values())

    async def teardown(self) -> None:
        await self.client.close()
