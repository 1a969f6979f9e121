"""Text prompts tokenized in the router, from the model's own tokenizer files (``route
--tokenizer DIR``; ``up`` passes the served model's directory), instead of a Tokenize call to
a server per request.

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

log = logging.getLogger(__name__)

# The probe compared with the servers' tokenizer: words, digits, spaces, punctuation, accents.
PROBE = "Hello, world!  The 3 quick foxes -- naïve café 12345 jumped.\nNew line\ttab"
# Tokenizes on a server: (text, add special tokens) -> ids.
RemoteTokenize = Callable[[str, bool], Awaitable[list[int]]]


class LocalTokenizer:
    """``tokenizer.json`` of a model directory (the Rust ``tokenizers`` library vLLM's fast
    tokenizers wrap), checked against a server's once before it is trusted."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # Whether it gives the servers' ids: decided once, by the first text prompt's call.
        self._verdict: asyncio.Future[bool] | None = None

    @classmethod
    def load(cls, directory: str | None) -> LocalTokenizer | None:
        """The directory's tokenizer; None (logged) when it has none the router can read."""
        if not directory:
            return None
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            log.warning(
                "--tokenizer %s: no tokenizer.json there; text prompts go to a server", path
            )
            return None
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    async def encode(
        self, text: str, add_special_tokens: bool, remote: RemoteTokenize
    ) -> list[int] | None:
        """``text``'s ids; None when a server must tokenize it (this tokenizer is not the
        servers', or the check could not be made yet)."""
        if self._verdict is None:
            self._verdict = asyncio.ensure_future(self._same_as(remote))
        try:
            same = await asyncio.shield(self._verdict)
        except Exception:  # no server could answer the check: try again next time
            self._verdict = None
            return None
        return self._encode(text, add_special_tokens) if same else None

    async def _same_as(self, remote: RemoteTokenize) -> bool:
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
