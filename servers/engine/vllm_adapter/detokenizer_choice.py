"""vLLM's fast detokenizer for a prompt that ends inside a character, primed as the stream
that generated those tokens would have been.

vLLM's fast detokenizer primes tokenizers' ``DecodeStream`` with the whole prompt. When the
prompt's last tokens hold only part of a character (a byte-level token, a byte-fallback one),
the stream's prefix stays empty and its first text is the whole prompt's text followed by the
output's (vLLM issue #48853, every release since vLLM primes the stream so). A continuation
(``skyrl_grpc.continuation``: an abort retry, a router migration) ends its prompt wherever the
cut fell, so one cut inside a character began its text, its parsed chat message and its stop
strings' search with the prompt.

Such a request's stream is primed with the prompt up to those tokens and then steps them, as
the stream that generated them did: it gives out nothing for them until the output completes
the character, and then the whole character. Its text then continues the text given out before
the cut exactly (what vLLM's slow detokenizer, the fix proposed upstream in vLLM PR #48854,
does not: it drops a character completed across the cut). Every other request is vLLM's own.
Deciding costs one decode of the prompt's last few tokens.
"""

from __future__ import annotations

from typing import Any

from skyrl_grpc.partial_characters import held_back

_INSTALLED = "_skyrl_grpc_partial_tail"


def install() -> None:
    """Gives vLLM's requests whose prompt ends inside a character a stream primed up to it
    (idempotent; vLLM's output processor builds every request's detokenizer through
    ``IncrementalDetokenizer.from_new_request``)."""
    import tokenizers
    from vllm.v1.engine import detokenizer

    factory = detokenizer.IncrementalDetokenizer
    if getattr(factory, _INSTALLED, False):
        return
    vllms_choice = factory.from_new_request.__func__  # type: ignore[attr-defined]

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        chosen = vllms_choice(cls, tokenizer, request)
        if not isinstance(chosen, detokenizer.FastIncrementalDetokenizer):
            return chosen
        prompt = request.prompt_token_ids or []
        skip = request.sampling_params.skip_special_tokens
        held = held_back(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip)), prompt)
        if held:
            chosen.stream = tokenizers.decoders.DecodeStream(
                ids=list(prompt[: len(prompt) - held]), skip_special_tokens=skip
            )
            for token_id in prompt[len(prompt) - held :]:
                chosen._protected_step(token_id)  # nothing given out: the character is open
        return chosen

    factory.from_new_request = classmethod(from_new_request)  # type: ignore[method-assign,assignment]
    setattr(factory, _INSTALLED, True)
