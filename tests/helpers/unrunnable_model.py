"""A checkpoint vLLM loads but cannot generate with on CPU: the tiny model with head_dim 16,
which CPU attention kernels reject at the first forward pass ("Unsupported CPU attention
configuration: head_dim=16"), after the engine reported itself started.

Usage: python -m tests.helpers.unrunnable_model OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from skyrl_grpc.tiny_model import ensure_tiny_model


def build(out: Path) -> Path:
    source = ensure_tiny_model()
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out / path.name)
    config = LlamaConfig.from_pretrained(source)
    config.num_attention_heads = 8
    config.num_key_value_heads = 8
    config.head_dim = 16
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]))
