"""The model's tokenizer as the servicers use it: text to ids and back, chat templates (their
refusals as the caller's errors), the end-of-sequence ids, the longest token's bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skyrl_grpc.errors import FailedPrecondition, InvalidArgument


class TokenizerCalls:
    """A Hugging Face tokenizer, for one served model."""

    def __init__(self, tokenizer: Any, served_model_name: str, hf_config: Any) -> None:
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self._hf_config = hf_config
        # The most bytes of text one token covers: text longer than the prompt limit times
        # this cannot fit, and is refused before the tokenizer runs.
        self.longest_token_bytes = max(
            (len(token.encode()) for token in tokenizer.get_vocab()), default=1
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not self._tokenizer.chat_template:
            raise FailedPrecondition(
                f"model {self._served_model_name!r} has no chat template: use Complete or "
                "Generate with your own prompt format"
            )
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja errors: the template rejected these messages
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
        # The template writes the special tokens (BOS, role markers) itself.
        return self.encode(str(text), add_special_tokens=False)

    def serialized(self) -> str:
        """The tokenizer as Hugging Face tokenizers' JSON (a tokenizer.json): a fast tokenizer's
        Rust backend, which tokenizes text as ``encode`` does."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise FailedPrecondition(
                f"model {self._served_model_name!r} has no fast tokenizer (tokenizer.json): its "
                "tokenizer cannot be handed to a router or client; tokenize with Tokenize"
            )
        return str(backend.to_str())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's end of sequence and the model's generation config's."""
        eos = self._tokenizer.eos_token_id
        ids = {eos} if eos is not None else set()
        generation_eos = getattr(self._hf_config, "eos_token_id", None)
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            ids.update(generation_eos)
        return sorted(ids)
