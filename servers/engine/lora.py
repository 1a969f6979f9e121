"""LoRA adapters on an engine server: checking them against the model, staging them, and the
registry of what is loaded.

Pure apart from files in the server's own staging directory: no engine, no gRPC. The control
plane feeds ``AdapterUpload`` what arrives, ``AdapterRegistry`` decides names, versions and
vLLM ids, and the engine adapter loads the staged directory into vLLM. An adapter is checked
completely (PEFT config, rank, target modules, every tensor's name, shape and checksum) before
vLLM sees it, so a bad one is refused with a message naming what is wrong while the previous
version keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_grpc import dtypes
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument, NotFound
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import lora_pb2

from .weights.assembly import InBandAssembler, ParamLayout

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
    manifest: cp.WeightManifest, expected: dict[str, tuple[int, ...]]
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
        dtype = dtypes.from_proto(spec.dtype, f"dtype of {name}")
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


class AdapterUpload:
    """One LoadLoraAdapter stream being received: spec, then (in-band) manifest and chunks."""

    def __init__(self, spec: cp.LoraAdapterSpec, max_rank: int, shapes: ModelShapes) -> None:
        if not spec.name:
            raise InvalidArgument("the adapter needs a name (LoraAdapterSpec.name)")
        self.spec = spec
        self.shapes = shapes
        if spec.path:
            directory = Path(spec.path)
            if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
                raise InvalidArgument(
                    f"{spec.path}: not a PEFT adapter directory on this server (needs "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE})"
                )
            text = (directory / CONFIG_FILE).read_text()
        else:
            if not spec.config_json:
                raise InvalidArgument(
                    "an in-band adapter needs its adapter_config.json (LoraAdapterSpec."
                    "config_json); or name a directory on the server (path)"
                )
            text = spec.config_json
        self.config = AdapterConfig.parse(text, max_rank, shapes)
        self.expected = self.config.expected(shapes)
        self._assembler: InBandAssembler | None = None

    @property
    def in_band(self) -> bool:
        return not self.spec.path

    def add(self, message: cp.LoadLoraAdapterRequest | WireChunk) -> None:
        if not self.in_band:
            raise InvalidArgument("an adapter loaded from a path takes no manifest or chunks")
        if isinstance(message, WireChunk) or message.WhichOneof("item") == "chunk":
            if self._assembler is None:
                raise InvalidArgument("the manifest must come before the adapter's chunks")
            if not isinstance(message, WireChunk):
                message = WireChunk.from_proto(message.chunk)
            self._assembler.add(message)
            return
        if message.WhichOneof("item") != "manifest":
            raise InvalidArgument("after the spec, send a manifest, then chunks")
        if self._assembler is not None:
            raise InvalidArgument("a second manifest in one LoadLoraAdapter stream")
        layout = check_manifest(message.manifest, self.expected)
        self._assembler = InBandAssembler(layout)
        self._assembler.add(cp.PushWeightsRequest(manifest=message.manifest))

    def stage(self, directory: Path | None) -> tuple[Path, bytes]:
        """Writes (in-band) or checks (path) the adapter into ``directory``, as vLLM loads it;
        returns the directory vLLM should load and the tensors' digest."""
        import torch
        from safetensors.torch import load_file, save_file

        if not self.in_band:
            tensors = load_file(str(Path(self.spec.path) / WEIGHTS_FILE))
            shapes = {name: tuple(t.shape) for name, t in tensors.items()}
            if shapes != self.expected:
                missing = sorted(set(self.expected) - set(shapes))
                wrong = sorted(
                    n for n in shapes if n in self.expected and shapes[n] != self.expected[n]
                )
                extra = sorted(set(shapes) - set(self.expected))
                raise InvalidArgument(
                    f"{self.spec.path}: tensors do not match the config and the model "
                    f"(missing {missing[:3]}, wrong shape {wrong[:3]}, unexpected {extra[:3]})"
                )
            return Path(self.spec.path), tensors_sha256(tensors)
        if self._assembler is None or directory is None:
            raise InvalidArgument("the stream ended before the adapter's manifest")
        tensors = {}
        for staged in self._assembler.finish():
            data = bytearray(b"".join(staged["chunks"]))
            dtype = getattr(torch, staged["dtype"])
            tensors[staged["name"]] = torch.frombuffer(data, dtype=dtype).reshape(staged["shape"])
        if not all(torch.isfinite(t).all() for t in tensors.values()):
            raise InvalidArgument("the adapter holds a NaN or an infinity")
        save_file(tensors, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.raw))
        return directory, tensors_sha256(tensors)


@dataclass
class LoadedAdapter:
    """One version of an adapter as vLLM holds it."""

    name: str
    version: int
    vllm_id: int  # vLLM's lora_int_id: unique per version
    path: Path
    config: AdapterConfig
    source: str
    sha256: bytes
    owned: bool  # the directory is the server's staging copy, removed with the version
    running: int = 0  # requests generating with this version

    def describe(self) -> lora_pb2.LoraAdapter:
        return lora_pb2.LoraAdapter(
            name=self.name,
            version=self.version,
            rank=self.config.rank,
            target_modules=list(self.config.target_modules),
            lora_alpha=self.config.alpha,
            source=self.source,
            sha256=self.sha256,
        )


@dataclass
class AdapterRegistry:
    """Names -> the adapter version serving now, and versions still running requests.

    ``staging``: the directory the server owns for in-band adapters (removed with the
    registry). ``max_adapters``: how many names may be loaded (--max-cpu-loras).
    """

    max_adapters: int
    staging: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="skyrl-lora-")))
    _serving: dict[str, LoadedAdapter] = field(default_factory=dict)
    _retired: dict[int, LoadedAdapter] = field(default_factory=dict)  # vllm_id -> old version
    _next_id: int = 1

    def staging_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{_safe(name)}-", dir=self.staging))

    def next_version(self, name: str, requested: int) -> int:
        current = self._serving.get(name)
        floor = current.version if current is not None else 0
        if requested and requested <= floor:
            raise FailedPrecondition(
                f"adapter {name!r} version {requested} is not newer than the version serving "
                f"({floor}): use a larger version, or 0 for the next one"
            )
        if current is None and len(self._serving) >= self.max_adapters:
            raise FailedPrecondition(
                f"{len(self._serving)} adapters are loaded, this server's limit "
                f"(--max-cpu-loras): unload one first ({', '.join(sorted(self._serving))})"
            )
        return requested or floor + 1

    def allocate_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def install(self, adapter: LoadedAdapter) -> tuple[LoadedAdapter | None, list[LoadedAdapter]]:
        """Makes ``adapter`` the serving version of its name; returns the version it replaced
        and the versions now unused (to remove from vLLM and disk)."""
        previous = self._serving.get(adapter.name)
        self._serving[adapter.name] = adapter
        if previous is not None:
            self._retired[previous.vllm_id] = previous
        return previous, self._collect()

    def unload(self, name: str) -> tuple[LoadedAdapter, list[LoadedAdapter]]:
        adapter = self._serving.pop(name, None)
        if adapter is None:
            raise NotFound(f"no adapter named {name!r} is loaded{self._names()}")
        self._retired[adapter.vllm_id] = adapter
        return adapter, self._collect()

    def begin(self, name: str) -> LoadedAdapter:
        """The version a new request named ``name`` runs on (counted until ``end``)."""
        adapter = self._serving.get(name)
        if adapter is None:
            raise NotFound(f"no LoRA adapter named {name!r}{self._names()}")
        adapter.running += 1
        return adapter

    def end(self, adapter: LoadedAdapter) -> list[LoadedAdapter]:
        adapter.running -= 1
        return self._collect()

    def serving(self) -> list[LoadedAdapter]:
        return [self._serving[name] for name in sorted(self._serving)]

    def _collect(self) -> list[LoadedAdapter]:
        done = [a for a in self._retired.values() if a.running <= 0]
        for adapter in done:
            del self._retired[adapter.vllm_id]
        return done

    def _names(self) -> str:
        names = sorted(self._serving)
        return f"; loaded: {', '.join(names)}" if names else "; none is loaded"

    def discard(self, adapters: Iterable[LoadedAdapter]) -> None:
        """Removes the staging copies of versions no longer used."""
        for adapter in adapters:
            if adapter.owned:
                shutil.rmtree(adapter.path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40] or "adapter"
