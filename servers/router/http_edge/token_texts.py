"""The text of each token a logprobs answer names, as vLLM's server writes it.

A token is its own decoding, except a byte-fallback piece of a multi-byte character, which
decodes alone to U+FFFD: vLLM's server (``LogprobsProcessor._correct_decoded_token``) decodes it
after up to four of the sample's preceding tokens instead, and gives it the text it completes
(the whole character, for the piece that ends it) or "" (a piece that does not). This follows
the same rule, so a logprobs answer's ``token``, ``bytes`` and ``text_offset`` are vLLM's.

``decode`` is the router's tokenizer where it decodes as the servers do, else a Detokenize
call; texts are kept per token sequence, so a token id is asked for once, and a byte piece's
context once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from skyrl_grpc.v1 import generation_pb2 as gen

Decode = Callable[[Sequence[int]], Awaitable[str]]
REPLACEMENT = "\ufffd"
# vLLM's: at most this many preceding tokens complete a piece.
MAX_CONTEXT = 4
# Decodings kept (one per token id, and one per context a byte piece needed).
MAX_KEPT = 1 << 17


class TokenTexts:
    """Token texts for logprobs answers, decoded once and kept."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, ...], str] = {}

    async def text(self, token_ids: Sequence[int], decode: Decode) -> str:
        key = tuple(token_ids)
        found = self._kept.get(key)
        if found is None:
            found = await decode(key)
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            self._kept[key] = found
        return found

    async def at_positions(
        self,
        sampled: Sequence[int],
        before: Sequence[int],
        logprobs: gen.Logprobs,
        decode: Decode,
    ) -> list[dict[int, str]]:
        """For each position of ``sampled`` (output tokens of one sample, after ``before``, its
        tokens answered earlier in the same stream), the text of the sampled token and of each
        alternative ``logprobs`` lists there."""
        per_position = []
        for position, token in enumerate(sampled):
            ids = [token]
            if position < len(logprobs.top_logprobs):
                ids += list(logprobs.top_logprobs[position].token_ids)
            per_position.append(ids)
        distinct = {t for ids in per_position for t in ids}
        await asyncio.gather(*(self.text((t,), decode) for t in distinct))
        answers = []
        for position, ids in enumerate(per_position):
            context = [*before, *sampled[:position]][-MAX_CONTEXT:]
            texts: dict[int, str] = {}
            for token in ids:
                alone = await self.text((token,), decode)
                if alone.endswith(REPLACEMENT):
                    alone = await self._completed(token, context, decode)
                texts[token] = alone
            answers.append(texts)
        return answers

    async def _completed(self, token: int, context: Sequence[int], decode: Decode) -> str:
        """vLLM's rule for a byte piece: the text it adds after the shortest context that
        completes it, or "" if none does."""
        for size in range(1, len(context) + 1):
            window = list(context[-size:])
            whole = await self.text([*window, token], decode)
            if whole.endswith(REPLACEMENT):
                continue
            clean = len(window)  # context pieces that were byte pieces themselves count here
            while clean > 0 and (await self.text((window[clean - 1],), decode)).endswith(
                REPLACEMENT
            ):
                clean -= 1
            prefix = await self.text(window[:clean], decode) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix) :]
            common = 0
            for a, b in zip(prefix, whole, strict=False):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""
