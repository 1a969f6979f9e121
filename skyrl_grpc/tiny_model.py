"""The embedded default model: a ~0.8M-parameter Llama built on the spot, with no download.

Every command of the stack defaults to this model so the whole loop runs on a laptop CPU. The
build is deterministic: a byte-level BPE tokenizer trained on ``data/tiny_corpus.txt`` (shipped
with the package) and seeded random weights, saved in Hugging Face format that vLLM and
``transformers`` load. The result is cached under the user cache directory, keyed by a hash of
everything that shapes it, so a changed recipe never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CORPUS_PATH = Path(__file__).with_name("data") / "tiny_corpus.txt"
# Bump when the recipe changes in a way the spec's fields do not capture.
RECIPE_VERSION = 2

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# A tool-calling template in the style of Hermes / Qwen 2.5 (tools listed in <tools>, calls
# written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>), so vLLM's `hermes`
# tool-call parser applies to the embedded model: `TinyModelSpec(chat_template="hermes")`.
HERMES_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response>{{ eos_token }}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT_TEMPLATES = {"plain": CHAT_TEMPLATE, "hermes": HERMES_CHAT_TEMPLATE}
# Reasoning markers, added as whole (not special) tokens to the "hermes" build so vLLM's
# token-based reasoning parsers (e.g. deepseek_r1) apply to it, as to Qwen3 or R1.
THINK_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built files (hashed into the cache key)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2  # head_dim 64: CPU attention rejects head_dim 16.
    num_key_value_heads: int = 1
    max_position_embeddings: int = 512
    seed: int = 0
    initializer_range: float = 0.02
    # Which chat template the tokenizer carries (CHAT_TEMPLATES): "plain" role turns, or
    # "hermes" tool calling.
    chat_template: str = "plain"
    # 0: a dense Llama. More: a mixture of experts in Mixtral's architecture (each layer's MLP
    # made of ``num_experts`` experts of ``intermediate_size``, ``experts_per_token`` of them
    # chosen per token), which vLLM serves from fused expert tensors.
    num_experts: int = 0
    experts_per_token: int = 2

    @property
    def architecture(self) -> str:
        return "mixtral" if self.num_experts else "llama"


# The fields of a mixture of experts: left out of a dense model's cache key, which stays what
# it was before they existed.
MOE_FIELDS = ("num_experts", "experts_per_token")
# The embedded mixture of experts: the tiny Llama's shape with 4 experts a layer, top-2.
TINY_MOE_SPEC = TinyModelSpec(num_experts=4, experts_per_token=2)
# The embedded models: what ``--model`` names each (None: the default, the tiny Llama), the
# name each is served as, and its recipe. Built on first use, on this machine; no download.
TINY_MODEL_NAME = "skyrl-tiny-llama"
EMBEDDED_MODELS: dict[str | None, tuple[str, TinyModelSpec]] = {
    None: (TINY_MODEL_NAME, TinyModelSpec()),
    "tiny-moe": ("skyrl-tiny-moe", TINY_MOE_SPEC),
}


def embedded_model_name(model: str | None) -> str | None:
    """The served name of the embedded model ``--model`` names (None or "": the tiny Llama;
    None returned: not an embedded model)."""
    entry = EMBEDDED_MODELS.get(model or None)
    return entry[0] if entry else None


def embedded_model_path(model: str | None) -> Path | None:
    """The built directory of the embedded model ``--model`` names (built now if needed;
    None: not an embedded model)."""
    entry = EMBEDDED_MODELS.get(model or None)
    return ensure_tiny_model(spec=entry[1]) if entry else None


def default_cache_dir() -> Path:
    """Where built models are kept: ``$SKYRL_GRPC_CACHE``, else ``$XDG_CACHE_HOME`` or ~/.cache."""
    if env := os.environ.get("SKYRL_GRPC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skyrl-grpc"


def _cache_key(spec: TinyModelSpec) -> str:
    digest = hashlib.sha256()
    fields = {k: v for k, v in asdict(spec).items() if spec.num_experts or k not in MOE_FIELDS}
    digest.update(json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True).encode())
    digest.update(CORPUS_PATH.read_bytes())
    digest.update(CHAT_TEMPLATES[spec.chat_template].encode())
    return digest.hexdigest()[:16]


def build_tiny_model(out_dir: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Builds the model into ``out_dir`` (created; must not exist or be empty) and returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        PreTrainedTokenizerFast,
    )

    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_PATH.read_text().splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATES[spec.chat_template],
        model_max_length=spec.max_position_embeddings,
    )
    if spec.chat_template == "hermes":
        hf_tokenizer.add_tokens(list(THINK_TOKENS))
    hf_tokenizer.save_pretrained(out_dir)

    shape: dict[str, Any] = dict(
        vocab_size=len(hf_tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    if spec.num_experts:
        config: Any = MixtralConfig(
            **shape,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            sliding_window=None,
        )
        model: Any = MixtralForCausalLM(config).to(torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def tiny_model_path(cache_dir: Path | None = None, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Where the build of ``spec`` is (or will be: ``ensure_tiny_model`` builds it)."""
    return (cache_dir or default_cache_dir()) / f"tiny-{spec.architecture}-{_cache_key(spec)}"


def ensure_tiny_model(cache_dir: Path | None = None, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Returns the cached build of ``spec``, building it first if needed (atomic: concurrent
    callers never see a half-written directory)."""
    root = cache_dir or default_cache_dir()
    target = tiny_model_path(root, spec)
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_tiny_model(staging, spec)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
