"""Text prompts tokenized in the router, instead of a Tokenize call to a server per request
(and the token texts a logprobs answer names decoded there, instead of a Detokenize call per
token the router has not seen):
from the model's own tokenizer files (``route --tokenizer DIR``; ``up`` passes the served
model's directory) or, on a host without them, from the tokenizer a server hands over
(``GetTokenizer``, read at the first text prompt).

The servers' tokenizer stays the reference: the first text prompt is tokenized both ways and
the router keeps tokenizing locally only if the ids are the same (a tokenizer file that is not
the served model's, or a tokenizer whose Python class adds what its file does not, turns it off
with a warning). Token texts are checked the same way, apart, at the first logprobs answer (a
server's tokenizer may clean up spaces its file knows nothing of). Chat conversations still go
to a server: their chat template, tools and generation prompt are the server's to render.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from grpc import StatusCode

from skyrl_grpc.errors import SkyrlError

log = logging.getLogger(__name__)

# The probe compared with the servers' tokenizer: words, digits, spaces, punctuation, accents.
PROBE = "Hello, world!  The 3 quick foxes -- naïve café 12345 jumped.\nNew line\ttab"
# The vocabulary's first ids each decoded both ways before the router's decoding is trusted.
DECODE_PROBE_IDS = 64
# Tokenizes on a server: (text, add special tokens) -> ids.
RemoteTokenize = Callable[[str, bool], Awaitable[list[int]]]
# A server's tokenizer, as tokenizers' JSON (GetTokenizer).
FetchTokenizer = Callable[[], Awaitable[str]]
# Decodes on a server, special tokens kept: ids -> text.
RemoteDecode = Callable[[Sequence[int]], Awaitable[str]]


class LocalTokenizer:
    """A tokenizer of the Rust ``tokenizers`` library vLLM's fast tokenizers wrap (a model
    directory's ``tokenizer.json``, or a server's), checked against a server's once before it
    is trusted: its ids for text prompts (``encode``), and apart from them its texts of token
    ids (``decode``, what a logprobs answer names each token by)."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        # None: a server's, read at the first text prompt.
        self._tokenizer = tokenizer
        # Whether it gives the servers' ids, and their texts: each decided once, by the first
        # call that needs it.
        self._verdict: asyncio.Future[bool] | None = None
        self._decode_verdict: asyncio.Future[bool] | None = None

    @classmethod
    def load(cls, directory: str | None) -> LocalTokenizer:
        """The directory's tokenizer; without one here (no directory, or one without a
        tokenizer.json on this host), a server's, read when the first text prompt comes."""
        if not directory:
            return cls()
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            log.warning(
                "--tokenizer %s: no tokenizer.json on this host; the servers' is read from one "
                "of them",
                path,
            )
            return cls()
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self._tokenizer is not None  # read before the check that trusts it
        # The same ids as ``encode``, without the character offsets nobody here reads: 20% less
        # CPU per prompt (149 -> 120 us for 128 tokens here).
        encoded = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoded[0].ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        assert self._tokenizer is not None
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))

    async def encode(
        self, text: str, add_special_tokens: bool, remote: RemoteTokenize, fetch: FetchTokenizer
    ) -> list[int] | None:
        """``text``'s ids; None when a server must tokenize it (this tokenizer is not the
        servers', no server could hand over its own, or the check could not be made yet)."""
        if self._verdict is None:
            self._verdict = asyncio.ensure_future(self._same_as(remote, fetch))
        if not await self._decided("_verdict"):
            return None
        return self._encode(text, add_special_tokens)

    async def decode(
        self, token_ids: Sequence[int], remote: RemoteDecode, fetch: FetchTokenizer
    ) -> str | None:
        """The text of ``token_ids`` (special tokens kept), as a server's Detokenize gives it;
        None when a server must decode them (as for ``encode``). Checked apart from the ids: a
        server's tokenizer may clean up spaces its file knows nothing of."""
        if self._decode_verdict is None:
            self._decode_verdict = asyncio.ensure_future(self._decodes_as(remote, fetch))
        if not await self._decided("_decode_verdict"):
            return None
        return self._decode(token_ids)

    async def _decided(self, which: str) -> bool:
        verdict: asyncio.Future[bool] = getattr(self, which)
        try:
            return await asyncio.shield(verdict)
        except Exception:  # no server could answer the check: try again next time
            setattr(self, which, None)
            return False

    async def _loaded(self, fetch: FetchTokenizer) -> bool:
        """Whether there is a tokenizer here: this host's, or one a server handed over."""
        if self._tokenizer is not None:
            return True
        try:
            serialized = await fetch()
        except SkyrlError as refused:  # a server that has none to hand over, or older
            if refused.code not in (StatusCode.UNIMPLEMENTED, StatusCode.FAILED_PRECONDITION):
                raise  # unreachable now: asked again at the next call
            log.warning("the servers hand over no tokenizer (%s): a server tokenizes", refused)
            return False
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(serialized)
            log.info("the router tokenizes with the tokenizer a server handed over")
        return True

    async def _same_as(self, remote: RemoteTokenize, fetch: FetchTokenizer) -> bool:
        if not await self._loaded(fetch):
            return False
        for special in (True, False):
            if self._encode(PROBE, special) != await remote(PROBE, special):
                log.warning(
                    "the router's tokenizer gives other ids than the servers' (add special "
                    "tokens: %s); text prompts go to a server",
                    special,
                )
                return False
        log.info("text prompts are tokenized in the router (same ids as the servers')")
        return True

    async def _decodes_as(self, remote: RemoteDecode, fetch: FetchTokenizer) -> bool:
        if not await self._loaded(fetch):
            return False
        assert self._tokenizer is not None
        ids = self._encode(PROBE, True)
        # The probe whole, each of its tokens alone, and the vocabulary's first ids alone
        # (special tokens and single bytes among them): how logprobs answers decode.
        first = range(min(self._tokenizer.get_vocab_size(), DECODE_PROBE_IDS))
        probes = [ids, *([i] for i in ids), *([i] for i in first)]
        answers = await asyncio.gather(*(remote(p) for p in probes))
        for probe, answer in zip(probes, answers, strict=True):
            if self._decode(probe) != answer:
                log.warning(
                    "the router's tokenizer decodes %s as %r, the servers' as %r: token texts "
                    "come from a server",
                    probe[:8],
                    self._decode(probe),
                    answer,
                )
                return False
        log.info("token texts are decoded in the router (the same as the servers')")
        return True
