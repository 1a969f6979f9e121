"""SkyRL's ``InferenceEngineInterface`` (skyrl 0.4.0) on this stack: SkyRL's generators and
trainer run unchanged.

``SkyRLInferenceEngine(router, servers)`` stands where SkyRL's ``RemoteInferenceClient``
stands (a trainer switches by overriding ``BasePPOExp.get_inference_client``; see the
README): ``generate`` goes through ``InferenceClient`` (gRPC streams through the router, a
session per trajectory, aborted samples resubmitted), control calls fan out to every server,
and ``update_named_weights`` pushes tensors with this stack's fleet-wide weight transaction
(in-band by default). ``chat_completion`` / ``completion`` go to the router's OpenAI HTTP edge
(``http_url``). Picklable like the client: only addresses and settings are kept.

Needs the ``skyrl`` extra (see the README: ``skyrl`` and ``skyrl-gym`` are installed without
their dependencies, whose pins would replace the transformers vLLM runs on; skyrl 0.4.0 declares
Python >= 3.12 and its code runs on this project's 3.11 once its ``TypedDict`` imports are
pydantic's, which ``scripts/skyrl_py311.py`` does to the installed files: SkyRL imports in any
order, and no name of the standard library is rebound).

What maps and what does not:
- Sampling dicts with SkyRL's (vLLM's) keys map onto ``SamplingParams``; an unknown key is an
  error naming it. ``n`` must be 1 (SkyRL samples repetitions as separate trajectories).
- ``cache_salt`` is accepted and not needed: servers salt the prefix cache with the weight
  version themselves, so no request reuses blocks computed under other weights.
- Weight sync: SkyRL 0.4.0's trainer-side weight-transfer engines drive vLLM's HTTP
  weight-update routes, which this stack does not serve; ``update_named_weights`` takes the
  tensors (``NamedTensorsRequest``, ``(name, tensor)`` pairs, or a dict with ``names`` and
  ``tensors``) and pushes them as one fleet-wide transaction, in-band (CRC-checked chunks,
  only what changed since the last push) or over this stack's collective
  (``transport="collective"`` after ``client.init_weight_transfer``). A dict of names, dtypes
  and shapes alone (SkyRL's NCCL / IPC metadata) is refused, naming why.
- LoRA: ``load_lora_adapter(name, path)`` and ``update_named_weights(LoraLoadRequest)`` load a
  PEFT directory on every server; generate with it by passing ``model=name``.
- ``pause_generation`` freezes running requests (KEEP), as SkyRL's does; ``pause(mode)`` takes
  "keep", "wait" or "abort".
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    from skyrl.backends.skyrl_train.inference_servers.base import (
        InferenceEngineInput,
        InferenceEngineInterface,
        InferenceEngineOutput,
    )
    from skyrl.backends.skyrl_train.weight_sync import LoraLoadRequest
except Exception as error:  # pydantic's PydanticUserError on an unpatched SkyRL
    if "typing_extensions.TypedDict" not in str(error):
        raise
    raise ImportError(
        "SkyRL 0.4.0 needs its TypedDict imports from typing_extensions on Python < 3.12: run "
        "`python scripts/skyrl_py311.py` in this environment (scripts/setup.sh does)"
    ) from error

from skyrl_grpc.concurrency import all_or_cancel
from trainer_client.client import InferenceClient
from trainer_client.exceptions import InferenceError
from trainer_client.results import GenerationResult
from trainer_client.weights.weight_updates import WeightTransport

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
class NamedTensorsRequest:
    """A weight update that carries its tensors (CPU, or any trainer that has them)."""

    names: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, Any]]) -> NamedTensorsRequest:
        pairs = list(named_tensors)
        return cls(names=[n for n, _ in pairs], tensors=[t for _, t in pairs])


# Tinker sampling key (SkyRL's ``sample``) -> SkyRL / vLLM key, as SkyRL's client maps them.
TINKER_SAMPLING_KEYS = {
    "temperature": "temperature",
    "max_tokens": "max_tokens",
    "seed": "seed",
    "top_k": "top_k",
    "top_p": "top_p",
    "stop_strings": "stop",
    "stop_tokens": "stop_token_ids",
}


class SkyRLInferenceEngine(InferenceEngineInterface):  # type: ignore[misc]
    """This stack as SkyRL's inference engine. ``servers``: every engine server (control
    calls fan out to them); ``http_url``: the router's OpenAI edge (``--http-port``), for
    ``chat_completion`` / ``completion``; ``transport``: how ``update_named_weights`` sends;
    ``compress_patches``: whether its patches travel zstd-compressed (``update_weights``)."""

    def __init__(
        self,
        router: str,
        servers: Sequence[str],
        *,
        model_name: str = "",
        http_url: str | None = None,
        transport: WeightTransport = "grpc",
        compress_patches: bool = False,
        **client_settings: Any,
    ) -> None:
        self.client = InferenceClient(router, servers, **client_settings)
        self._model_name = model_name
        self.http_url = http_url
        self.transport = transport
        self.compress_patches = compress_patches
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
        lora = self._adapter_of(model)
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
        starts = input_batch.get("routed_experts_prompt_starts")
        results = await self._generate_batches(
            prompts,
            sampling,
            [None if s is None else str(s) for s in sessions],
            lora,
            starts,
        )
        with_logprobs = sampling.get("logprobs") is not None
        return InferenceEngineOutput(
            responses=[(r.text or "") + (r.stop_text or "" if keep_stop else "") for r in results],
            response_ids=[list(r.token_ids) for r in results],
            stop_reasons=[r.finish_reason.value for r in results],  # vLLM's names, as SkyRL's
            response_logprobs=[list(r.logprobs or []) for r in results] if with_logprobs else None,
            prompt_logprobs=None,
            # SkyRL's R3: [tokens, layers, top-k] per prompt, from each prompt's start
            rollout_expert_indices=(
                None if starts is None else [r.routed_experts for r in results]
            ),
            rollout_sample_support=None,
        )

    async def _generate_batches(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        sessions: list[str | None],
        lora: str,
        experts_starts: Sequence[int] | None,
    ) -> list[GenerationResult]:
        """The batch as batched calls (one GenerateBatch per server; one failure cancels the
        rest, aborting their requests on the servers). With SkyRL's
        ``routed_experts_prompt_starts``, each prompt asks for its routed experts from its
        start: prompts that share a start share a batch, since a batch takes one sampling."""
        if experts_starts is None:
            return await self.client.generate_batch(
                prompts, sampling, session_ids=sessions, include_text=True, lora=lora
            )
        if len(experts_starts) != len(prompts):
            raise ValueError(
                f"{len(experts_starts)} routed_experts_prompt_starts for {len(prompts)} prompts"
            )
        by_start: dict[int, list[int]] = {}
        for index, start in enumerate(experts_starts):
            by_start.setdefault(int(start), []).append(index)
        groups = list(by_start.items())
        answers = await all_or_cancel(
            self.client.generate_batch(
                [prompts[i] for i in indices],
                {**sampling, "return_routed_experts": True, "routed_experts_prompt_start": start},
                session_ids=[sessions[i] for i in indices],
                include_text=True,
                lora=lora,
            )
            for start, indices in groups
        )
        results: dict[int, GenerationResult] = {}
        for (_, indices), answer in zip(groups, answers, strict=True):
            results.update(zip(indices, answer, strict=True))
        return [results[i] for i in range(len(prompts))]

    def _adapter_of(self, model: str | None) -> str:
        """The LoRA adapter a request's ``model`` names ("" for the base model); the servers
        refuse a name no one loaded (NOT_FOUND)."""
        if not model or model == self._model_name:
            return ""
        return model

    async def sample(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """SkyRL's Tinker-style ``sample``: ``num_samples`` completions of a token prompt in one
        session, as ``RemoteInferenceClient.sample`` answers (without prompt logprobs)."""
        body = dict(request_payload.get("json", {}))
        if body.get("include_prompt_logprobs") or body.get("prompt_logprobs"):
            raise ValueError("sample: prompt logprobs are not supported by skyrl-grpc")
        chunks = body.get("prompt", {}).get("chunks", [])
        if any(c.get("type", "encoded_text") != "encoded_text" for c in chunks):
            raise ValueError("sample: only token (encoded_text) prompt chunks are supported")
        prompt = [int(t) for c in chunks for t in c.get("tokens", [])]
        tinker = body.get("sampling_params") or {}
        unknown = sorted(set(tinker) - set(TINKER_SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"sample: sampling params {unknown} are not supported; supported: "
                f"{', '.join(sorted(TINKER_SAMPLING_KEYS))}"
            )
        params = {TINKER_SAMPLING_KEYS[k]: v for k, v in tinker.items() if v is not None}
        sampling, _ = sampling_from_skyrl({**params, "logprobs": 0})
        session = request_payload.get("session_id") or body.get("session_id")
        results = await self.client.sample(
            prompt,
            sampling,
            n=int(body.get("num_samples", 1)),
            session_id=None if session is None else str(session),
            lora=self._adapter_of(body.get("model")),
        )
        return {
            "type": "sample",
            "sequences": [
                {
                    "tokens": list(r.token_ids),
                    "logprobs": list(r.logprobs or []),
                    "stop_reason": r.finish_reason.value,
                }
                for r in results
            ],
            "prompt_logprobs": None,
            "topk_prompt_logprobs": None,
        }

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
        # The data plane's bearer token, as the gRPC calls carry it (the edge forwards it to
        # the servers), unless the caller's headers bring one.
        headers = {
            **dict(self.client.config.metadata("data")),
            **(request_payload.get("headers") or {}),
        }
        response = await http.post(
            f"{self.http_url.rstrip('/')}{path}",
            json=request_payload.get("json", {}),
            headers=headers,
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
        # vLLM's render answer, as SkyRL reads it (``token_ids``, ``features``).
        return {"token_ids": ids, "features": None, "model": body.get("model", self._model_name)}

    # -- control plane -----------------------------------------------------------------------

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict[str, Any]:
        """Pauses every server (``mode``: "keep" freezes running requests, "wait" lets them
        finish, "abort" ends them); returns what SkyRL's client returns, per server."""
        paused = await self.client.pause(str(getattr(mode, "value", mode)), clear_cache=clear_cache)
        return {address: {"paused": True} for address in paused}

    async def resume(self) -> dict[str, Any]:
        return {address: {"resumed": True} for address in await self.client.resume()}

    async def pause_generation(self, clear_cache: bool = False) -> dict[str, Any]:
        # SkyRL's pause freezes in-flight requests and resumes them in place: KEEP.
        return await self.pause("keep", clear_cache=clear_cache)

    async def resume_generation(self) -> dict[str, Any]:
        return await self.resume()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self.client.reset_prefix_cache()

    async def sleep(self, level: int = 2, tags: list[str] | None = None) -> None:
        """Refused on CPU servers before anything is sent (``Unsupported``, naming why)."""
        await self.client.sleep(int(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.client.wake_up(tuple(tags or ()))

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | None = None, *, in_memory: bool = False
    ) -> dict[str, Any]:
        """Loads the PEFT directory ``lora_path`` (readable by every server) as ``lora_name``
        on every server; generate with ``model=lora_name``."""
        if in_memory or lora_path is None:
            raise ValueError(
                "load_lora_adapter needs lora_path here: adapters staged in-memory by SkyRL's "
                "weight-transfer engines do not reach this stack (client.load_lora(name, "
                "tensors=..., config=...) sends them in-band)"
            )
        loaded = await self.client.load_lora(lora_name, path=lora_path)
        return {
            address: {"lora_name": lora_name, "version": a.version} for address, a in loaded.items()
        }

    async def update_named_weights(self, request: Any) -> dict[str, Any]:
        """Pushes tensors (``NamedTensorsRequest``, a dict with ``names`` and ``tensors``, or
        ``(name, tensor)`` pairs) to every server as one transaction and records the version
        committed; a ``LoraLoadRequest`` loads that adapter instead."""
        if isinstance(request, LoraLoadRequest):
            return await self.load_lora_adapter(request.lora_name, request.lora_path)
        if isinstance(request, NamedTensorsRequest):
            pairs = list(zip(request.names, request.tensors, strict=True))
        elif isinstance(request, dict):
            if "tensors" not in request:
                raise NotImplementedError(
                    f"a weight update of {sorted(request)} carries no tensors (SkyRL's NCCL / IPC "
                    "engines send them on their own channel, which this stack does not receive): "
                    "pass NamedTensorsRequest.of(model.named_parameters()) or a dict with names "
                    "and tensors"
                )
            pairs = list(zip(request["names"], request["tensors"], strict=True))
        else:
            pairs = list(request)
        committed = await self.client.update_weights(
            pairs, transport=self.transport, compress_patches=self.compress_patches
        )
        self._weight_version = max(int(r.weight_version) for r in committed.values())
        return {a: {"weight_version": int(r.weight_version)} for a, r in committed.items()}

    async def teardown(self) -> None:
        await self.client.close()
