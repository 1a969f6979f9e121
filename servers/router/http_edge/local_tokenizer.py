"""Text prompts tokenized in the router, instead of a Tokenize call to a server per request:
from the model's own tokenizer files (``route --tokenizer DIR``; ``up`` passes the served
model's directory) or, on a host without them, from the tokenizer a server hands over
(``GetTokenizer``, read at the first text prompt).

The servers' tokenizer stays the reference: the first text prompt is tokenized both ways and
the router keeps tokenizing locally only if the ids are the same (a tokenizer file that is not
the served model's, or a tokenizer whose Python class adds what its file does not, turns it off
with a warning). Chat conversations still go to a server: their chat template, tools and
generation prompt are the server's to render.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from grpc import StatusCode

from skyrl_grpc.errors import SkyrlError

log = logging.getLogger(__name__)

# The probe compared with the servers' tokenizer: words, digits, spaces, punctuation, accents.
PROBE = "Hello, world!  The 3 quick foxes -- naïve café 12345 jumped.\nNew line\ttab"
# Tokenizes on a server: (text, add special tokens) -> ids.
RemoteTokenize = Callable[[str, bool], Awaitable[list[int]]]
# A server's tokenizer, as tokenizers' JSON (GetTokenizer).
FetchTokenizer = Callable[[], Awaitable[str]]


class LocalTokenizer:
    """A tokenizer of the Rust ``tokenizers`` library vLLM's fast tokenizers wrap (a model
    directory's ``tokenizer.json``, or a server's), checked against a server's once before it
    is trusted."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        # None: a server's, read at the first text prompt.
        self._tokenizer = tokenizer
        # Whether it gives the servers' ids: decided once, by the first text prompt's call.
        self._verdict: asyncio.Future[bool] | None = None

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
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    async def encode(
        self, text: str, add_special_tokens: bool, remote: RemoteTokenize, fetch: FetchTokenizer
    ) -> list[int] | None:
        """``text``'s ids; None when a server must tokenize it (this tokenizer is not the
        servers', no server could hand over its own, or the check could not be made yet)."""
        if self._verdict is None:
            self._verdict = asyncio.ensure_future(self._same_as(remote, fetch))
        try:
            same = await asyncio.shield(self._verdict)
        except Exception:  # no server could answer the check: try again next time
            self._verdict = None
            return None
        return self._encode(text, add_special_tokens) if same else None

    async def _same_as(self, remote: RemoteTokenize, fetch: FetchTokenizer) -> bool:
        if self._tokenizer is None:
            try:
                serialized = await fetch()
            except SkyrlError as refused:  # a server that has none to hand over, or older
                if refused.code not in (StatusCode.UNIMPLEMENTED, StatusCode.FAILED_PRECONDITION):
                    raise  # unreachable now: asked again at the next text prompt
                log.warning(
                    "the servers hand over no tokenizer (%s): text prompts go to a server", refused
                )
                return False
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(serialized)
            log.info("the router tokenizes with the tokenizer a server handed over")
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
