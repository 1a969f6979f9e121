"""``skyrl_grpc.partial_characters.held_back``: how many of a cut sequence's last tokens a
streaming detokenizer has given out no text for, on a byte tokenizer (each token some bytes
of UTF-8, decoded with replacement as tokenizers do)."""

from __future__ import annotations

from skyrl_grpc.partial_characters import WINDOW, held_back

# A token's bytes: "a", "b", the four bytes of U+1F642 one per token, an invalid lead byte.
VOCAB = [b"a", b"b", b"\xf0", b"\x9f", b"\x99", b"\x82", b"\xd7"]
A, B, E1, E2, E3, E4, BAD = range(len(VOCAB))


def decode(token_ids: list[int]) -> str:
    return b"".join(VOCAB[t] for t in token_ids).decode("utf-8", errors="replace")


def test_tokens_inside_a_character_are_held_until_it_completes() -> None:
    emoji = [A, E1, E2, E3, E4]
    assert [held_back(decode, emoji[:cut]) for cut in range(1, 6)] == [0, 1, 2, 3, 0]
    assert held_back(decode, [A, B]) == 0
    assert held_back(decode, []) == 0
    # A single token holding part of a character, with nothing before it.
    assert held_back(decode, [E1]) == 1


def test_a_byte_that_can_never_complete_is_held_only_at_the_end() -> None:
    """An invalid byte followed by more text decodes as U+FFFD there: whole, given out."""
    assert held_back(decode, [A, BAD]) == 1
    assert held_back(decode, [A, BAD, B]) == 0
    assert held_back(decode, [A, BAD, E1, E2]) == 3


def test_a_long_sequence_is_read_only_at_its_end() -> None:
    read: list[int] = []

    def counting(token_ids: list[int]) -> str:
        read.append(len(token_ids))
        return decode(token_ids)

    assert held_back(counting, [A] * 10_000 + [E1, E2]) == 2
    assert max(read) <= WINDOW
