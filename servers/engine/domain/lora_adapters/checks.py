"""What a LoRA adapter must be to load: checked against the base model's shapes and the
server's limits before vLLM sees it, so a bad adapter is refused with a message naming what is
wrong. Pure (no engine, no gRPC server); reads the contract's manifest message."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers.engine.transfer.assembly import ParamLayout
from servers.engine.transfer.specs import Manifest
from skyrl_grpc.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Where each adaptable module sits in a Llama-style decoder layer.
MODULE_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16"}
# vLLM id of the all-zero adapter base-model requests use on CPU; loaded adapters count from 1.
ZERO_ADAPTER_ID = 2**31 - 1


@dataclass(frozen=True)
class ModelShapes:
    """What an adapter must fit: the base model's layers and projection sizes."""

    layers: int
    features: dict[str, tuple[int, int]]  # module -> (in_features, out_features)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShapes:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or hidden // heads)
        inner = int(config["intermediate_size"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            features={
                "lm_head": (hidden, int(config["vocab_size"])),
                "q_proj": (hidden, heads * head_dim),
                "k_proj": (hidden, kv_heads * head_dim),
                "v_proj": (hidden, kv_heads * head_dim),
                "o_proj": (heads * head_dim, hidden),
                "gate_proj": (hidden, inner),
                "up_proj": (hidden, inner),
                "down_proj": (inner, hidden),
            },
        )


@dataclass(frozen=True)
class AdapterConfig:
    """A checked PEFT LoRA config."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    raw: dict[str, Any]

    @classmethod
    def parse(cls, text: str, max_rank: int, shapes: ModelShapes) -> AdapterConfig:
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise InvalidArgument(f"{CONFIG_FILE} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise InvalidArgument(f"{CONFIG_FILE} must be a JSON object")
        if str(raw.get("peft_type", "LORA")).upper() != "LORA":
            raise InvalidArgument(f"peft_type {raw.get('peft_type')!r}: only LORA adapters load")
        rank = raw.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidArgument(f'{CONFIG_FILE}: "r" (the rank) must be an integer >= 1')
        if rank > max_rank:
            raise InvalidArgument(
                f"rank {rank} exceeds this server's limit of {max_rank}: lower r, or start the "
                "server with a larger --max-lora-rank"
            )
        alpha = raw.get("lora_alpha", rank)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise InvalidArgument(f'{CONFIG_FILE}: "lora_alpha" must be a number')
        targets = raw.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets:
            raise InvalidArgument(f'{CONFIG_FILE}: "target_modules" must list module names')
        unknown = sorted(set(targets) - set(shapes.features))
        if unknown:
            raise InvalidArgument(
                f"target modules {unknown} are not in the model; it has "
                f"{', '.join(shapes.features)}"
            )
        for key in ("modules_to_save", "layers_to_transform"):
            if raw.get(key):
                raise InvalidArgument(f'{CONFIG_FILE}: "{key}" is not supported')
        if raw.get("bias", "none") != "none":
            raise InvalidArgument(f'{CONFIG_FILE}: "bias" must be "none"')
        return cls(rank, float(alpha), tuple(sorted(set(targets))), raw)

    def expected(self, shapes: ModelShapes) -> dict[str, tuple[int, ...]]:
        """Every tensor the adapter must carry (PEFT names) and its shape."""
        tensors: dict[str, tuple[int, ...]] = {}
        prefixes = []
        for module in self.target_modules:
            if module == "lm_head":  # the output projection, once
                prefixes.append(("base_model.model.lm_head", module))
                continue
            for layer in range(shapes.layers):
                block = MODULE_BLOCK[module]
                prefixes.append((f"base_model.model.model.layers.{layer}.{block}.{module}", module))
        for prefix, module in prefixes:
            in_features, out_features = shapes.features[module]
            tensors[f"{prefix}.lora_A.weight"] = (self.rank, in_features)
            tensors[f"{prefix}.lora_B.weight"] = (out_features, self.rank)
        return tensors


def check_manifest(
    manifest: Manifest, expected: dict[str, tuple[int, ...]]
) -> dict[str, ParamLayout]:
    """The layout an in-band adapter's chunks are checked against: exactly the expected
    tensors, each with its expected shape and a floating-point dtype."""
    sent = {spec.name: spec for spec in manifest.parameters}
    missing = sorted(set(expected) - set(sent))
    extra = sorted(set(sent) - set(expected))
    if missing or extra:
        detail = []
        if missing:
            detail.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            detail.append(f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        raise InvalidArgument(
            f"the adapter's tensors do not match its config: {'; '.join(detail)} (PEFT names, "
            "e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)"
        )
    layout: dict[str, ParamLayout] = {}
    for name, spec in sent.items():
        dtype = spec.dtype
        if dtype.torch_name not in FLOAT_DTYPES:
            raise InvalidArgument(f"{name}: dtype {dtype.torch_name}, adapters are floating point")
        if tuple(spec.shape) != expected[name]:
            raise InvalidArgument(
                f"shape mismatch for {name}: sent {list(spec.shape)}, the model needs "
                f"{list(expected[name])}"
            )
        layout[name] = ParamLayout(dtype, tuple(spec.shape))
    return layout


def tensors_sha256(tensors: dict[str, Any]) -> bytes:
    """One digest of an adapter's tensors: names in sorted order, each followed by its bytes."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(-1).view(dtype=torch.uint8).numpy())
    return digest.digest()


def write_zero_adapter(directory: Path, shapes: ModelShapes) -> None:
    """An adapter whose update is exactly zero (rank 1 on q_proj, both factors zero)."""
    import torch
    from safetensors.torch import save_file

    in_features, out_features = shapes.features["q_proj"]
    tensors = {}
    for layer in range(shapes.layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(1, in_features)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out_features, 1)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
