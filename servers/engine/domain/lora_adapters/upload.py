"""One LoadLoraAdapter stream being received: the spec, then (in-band) the manifest and
chunks, checked as they come; ``stage`` writes the adapter where vLLM loads it from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from servers.engine.domain.lora_adapters.checks import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    ModelShapes,
    check_manifest,
    tensors_sha256,
)
from servers.engine.transfer.assembly import InBandAssembler
from servers.engine.transfer.specs import Manifest
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import InvalidArgument


@dataclass(frozen=True)
class AdapterSpec:
    """What a LoadLoraAdapter stream opens with: the adapter's name, and either a directory
    on this server holding it (``path``) or its config for the chunks that follow."""

    name: str
    path: str = ""
    config_json: str = ""
    # The version to load it as (0: the next one).
    version: int = 0


@dataclass(frozen=True)
class AdapterCopy:
    """A loaded adapter as a peer loads it in-band: its spec (config and version) and its
    tensors (PEFT name, torch dtype name, shape, raw bytes), in name order."""

    spec: AdapterSpec
    tensors: list[tuple[str, str, tuple[int, ...], bytes]]


def read_tensors(directory: Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """The tensors of the adapter staged or named at ``directory``, as ``AdapterCopy`` holds
    them."""
    from safetensors.torch import load_file

    from skyrl_grpc.tensor_bytes import flat_bytes

    tensors = load_file(str(directory / WEIGHTS_FILE))
    return [
        (
            name,
            str(tensors[name].dtype).removeprefix("torch."),
            tuple(tensors[name].shape),
            flat_bytes(tensors[name]).numpy().tobytes(),
        )
        for name in sorted(tensors)
    ]


class AdapterUpload:
    """One LoadLoraAdapter stream being received: spec, then (in-band) manifest and chunks."""

    def __init__(self, spec: AdapterSpec, max_rank: int, shapes: ModelShapes) -> None:
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

    def add(self, item: Manifest | WireChunk) -> None:
        """Takes the stream's next item after the spec: the manifest, then its chunks."""
        if not self.in_band:
            raise InvalidArgument("an adapter loaded from a path takes no manifest or chunks")
        if isinstance(item, WireChunk):
            if self._assembler is None:
                raise InvalidArgument("the manifest must come before the adapter's chunks")
            self._assembler.add(item)
            return
        if self._assembler is not None:
            raise InvalidArgument("a second manifest in one LoadLoraAdapter stream")
        layout = check_manifest(item, self.expected)
        self._assembler = InBandAssembler(layout)
        self._assembler.add(item)

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
