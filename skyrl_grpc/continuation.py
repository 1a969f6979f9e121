"""Resuming a generation elsewhere: the request that continues one sample after some tokens.

Two places resubmit a sample that was cut short: the trainer client after a pause in ABORT mode
(``trainer_client.abort_retry``) and the router when a server dies mid-stream
(``servers.router.migration``). Both send the prompt plus every token generated so far with
what is left of the budget, so the result reads like one uninterrupted generation; this module
is that rule, written once. The continuation also names the weight version of the tokens so
far (``min_weight_version``): it goes on only on a server at least that new, so a sample's
weight versions never go backwards (a server restarted on older weights, or one a partition
kept from the last update, is never where it continues).
"""

from __future__ import annotations

from collections.abc import Sequence

from skyrl_grpc.v1 import data_plane_pb2


def resumable(request: data_plane_pb2.GenerateStreamRequest) -> bool:
    """Whether a sample cut after some tokens can go on from them. Not when its output is
    constrained -- a structured output, or tools offered to a chat output (a tool choice may
    constrain the output on the server): the engine compiles a constraint for a whole output,
    so a continuation would start it over in the middle. Such a sample starts over instead."""
    if request.sampling_params.HasField("structured_output"):
        return False
    return not (request.HasField("chat_output") and request.chat_output.tool_use.tools)


def continue_request(
    request: data_plane_pb2.GenerateStreamRequest,
    generated: Sequence[int],
    version: int,
    experts_rows: int = 0,
) -> data_plane_pb2.GenerateStreamRequest:
    """``request`` continued after ``generated`` tokens of its (single) sample, the newest of
    them made at weight ``version``, with ``experts_rows`` rows of its routed experts received
    (the continuation's then start after them: the earlier tokens' routing is the one that
    produced them, and none comes twice).

    The prompt grows by the generated tokens; ``max_tokens`` and ``min_tokens`` shrink by their
    count (an unset ``max_tokens`` stays unset: the server fills the context, as before). Prompt
    logprobs are not asked for again: the continuation's "prompt" includes generated tokens,
    and the caller received the real prompt's logprobs with the first attempt.
    """
    continued = data_plane_pb2.GenerateStreamRequest()
    continued.CopyFrom(request)
    continued.prompt_token_ids.extend(generated)
    params = continued.sampling_params
    done = len(generated)
    if params.HasField("max_tokens"):
        params.max_tokens = params.max_tokens - done
    if params.HasField("min_tokens"):
        params.min_tokens = max(params.min_tokens - done, 0)
    params.ClearField("prompt_logprobs")
    if params.return_routed_experts:
        params.routed_experts_prompt_start += experts_rows
    continued.min_weight_version = max(continued.min_weight_version, version)
    if continued.HasField("chat_output"):
        # The server's chat parser reads the tokens so far before the new ones.
        continued.chat_output.resumed_tokens += done
    return continued
