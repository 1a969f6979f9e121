"""A PEFT-format LoRA adapter for the tiny models, made up in the test (no hub), and the
reference it is held to: transformers with the adapter merged into the base weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def make_adapter(
    model_dir: Path, seed: int, rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT-format adapter with random factors large enough to change greedy output."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    out = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    if "lm_head" in targets:  # the output projection: once, not per layer
        tensors["base_model.model.lm_head.lora_A.weight"] = (
            torch.randn(rank, hidden, generator=generator) / 2
        )
        tensors["base_model.model.lm_head.lora_B.weight"] = (
            torch.randn(config["vocab_size"], rank, generator=generator) / 2
        )
    for layer in range(config["num_hidden_layers"]):
        for module in (t for t in targets if t != "lm_head"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / 2
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out[module], rank, generator=generator) / 2
            )
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    return tensors, adapter_config


def merged_reference(
    model_dir: Path,
    adapter: tuple[dict[str, torch.Tensor], dict[str, Any]] | None,
    prompts: list[list[int]],
    max_new_tokens: int = 12,
) -> list[list[int]]:
    """Greedy outputs of transformers with the adapter merged into the base weights
    (W + alpha/r * B A), ``max_new_tokens`` for each of ``prompts``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        tensors, config = adapter
        scale = config["lora_alpha"] / config["r"]
        with torch.no_grad():
            if "lm_head" in config["target_modules"]:
                a = tensors["base_model.model.lm_head.lora_A.weight"]
                b = tensors["base_model.model.lm_head.lora_B.weight"]
                model.lm_head.weight += scale * (b @ a)
            for layer_index, layer in enumerate(model.model.layers):
                for module in (t for t in config["target_modules"] if t != "lm_head"):
                    prefix = f"base_model.model.model.layers.{layer_index}.self_attn.{module}"
                    a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
                    getattr(layer.self_attn, module).weight += scale * (b @ a)
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs
