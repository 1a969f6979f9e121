"""What one request may ask of an engine server (``RequestLimits``), and their flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of a server, and how much generation it takes at once. Every
    refusal names the limit and the flag that raises it; all are checked before the engine
    sees the request (and before the prompt is even tokenized)."""

    # Samples per request (n).
    max_n: int = 128
    # Prompt tokens; None: what the model's context leaves room for (one token for output).
    max_prompt_tokens: int | None = None
    # Bytes of a caller-chosen request_id (it is echoed in every message and log line).
    max_request_id_bytes: int = 256
    # Top logprobs per position (logprobs, prompt_logprobs): vLLM computes them all per step.
    max_logprobs: int = 20
    # Samples generating at once (a request of n samples counts n); more wait their turn.
    max_concurrent_samples: int = 1024
    # Requests waiting for a turn; beyond this, RESOURCE_EXHAUSTED.
    max_queued_requests: int = 4096


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RequestLimits()
    group = parser.add_argument_group("request limits (refused with a message naming the flag)")
    group.add_argument("--max-n", type=int, default=defaults.max_n, help="samples per request")
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=defaults.max_prompt_tokens,
        help="prompt tokens per request (default: the model's context minus one)",
    )
    group.add_argument("--max-request-id-bytes", type=int, default=defaults.max_request_id_bytes)
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        help="top logprobs per position (logprobs, prompt_logprobs)",
    )
    group.add_argument(
        "--max-concurrent-samples",
        type=int,
        default=defaults.max_concurrent_samples,
        help="samples generating at once; more requests wait their turn",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests waiting for a turn; beyond this: RESOURCE_EXHAUSTED",
    )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_n=args.max_n,
        max_prompt_tokens=args.max_prompt_tokens,
        max_request_id_bytes=args.max_request_id_bytes,
        max_logprobs=args.max_logprobs,
        max_concurrent_samples=args.max_concurrent_samples,
        max_queued_requests=args.max_queued_requests,
    )
