"""Tokens that hold part of a character: what a streaming detokenizer has not given out yet.

A byte-level or byte-fallback tokenizer spreads one character's bytes over several tokens, so
the text of a sequence cut after any token can end inside a character (decoded, a trailing
U+FFFD). A streaming detokenizer (vLLM's, tokenizers' ``DecodeStream``) gives out no text for
such tokens until a later one completes the character. A sample continued after a cut
(``skyrl_grpc.continuation``) must therefore begin its text with those tokens' character, and
its tokens so far must be read as the text given out before the cut: both ends count the held
tokens with ``held_back``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
# Enough tokens to hold one character whole (UTF-8: at most 4 bytes, a byte per token at worst)
# and more than one such character in a row, while reading a long text's end costs little.
WINDOW = 16


def held_back(decode: Callable[[list[int]], str], token_ids: Sequence[int]) -> int:
    """How many of ``token_ids``' last tokens a streaming detokenizer holds back: those after
    the last point where their text ends on a whole character (0 when it does at the end; at
    most ``WINDOW``)."""
    tail = list(token_ids[-WINDOW:])
    if not tail or not decode(tail).endswith(REPLACEMENT):
        return 0
    for held in range(1, len(tail)):
        if not decode(tail[: len(tail) - held]).endswith(REPLACEMENT):
            return held
    return len(tail)
