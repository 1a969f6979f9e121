"""The server's LoRA path on its own (``servers.engine.domain.lora_adapters``): checks, staging, versions,
and removal of versions no request uses, against a stand-in for vLLM's add/remove calls (the
subject is the manager; ``test_lora.py`` runs the same path on real vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from servers.engine.domain.lora_adapters import (
    AdapterLimits,
    AdapterManager,
    AdapterSpec,
    EngineAdapterCalls,
    ModelShapes,
)
from servers.engine.peers.stream_items import adapter_item, adapter_spec
from skyrl_grpc.errors import FailedPrecondition, InvalidArgument, NotFound
from skyrl_grpc.v1 import control_plane_pb2 as cp
from tests.helpers.waits import until
from trainer_client.weights.weight_sending import lora_push_messages

SHAPES = ModelShapes(layers=2, features={"q_proj": (8, 8), "v_proj": (8, 4), "lm_head": (8, 32)})
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


class StandInEngine:
    """Records what the manager asks of the engine; ``accept``: whether ``add`` succeeds."""

    def __init__(self) -> None:
        self.accept = True
        self.loaded: dict[int, Path] = {}
        self.removed: list[int] = []

    async def add(self, name: str, engine_id: int, directory: Path) -> bool:
        assert (directory / "adapter_config.json").is_file()
        assert (directory / "adapter_model.safetensors").is_file()
        if self.accept:
            self.loaded[engine_id] = directory
        return self.accept

    async def remove(self, engine_id: int) -> None:
        self.removed.append(engine_id)
        self.loaded.pop(engine_id)


def adapter(seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{ab}.weight": torch.randn(
            shape, generator=generator
        )
        for layer in range(SHAPES.layers)
        for ab, shape in (("A", (rank, 8)), ("B", (8, rank)))
    }


def manager_of(engine: StandInEngine, max_adapters: int = 2) -> AdapterManager:
    limits = AdapterLimits(True, max_loras=2, max_lora_rank=4, max_cpu_loras=max_adapters)
    return AdapterManager(limits, SHAPES, EngineAdapterCalls(engine.add, engine.remove))


async def load(
    manager: AdapterManager, name: str, seed: int, config: dict[str, Any] = CONFIG, version: int = 0
) -> Any:
    spec = cp.LoraAdapterSpec(name=name, config_json=json.dumps(config), version=version)
    upload = manager.upload(adapter_spec(cp.LoadLoraAdapterRequest(spec=spec)))
    for message in lora_push_messages(adapter(seed, config["r"]).items()):
        upload.add(adapter_item(message))
    return await manager.load(upload)


async def test_a_new_version_replaces_the_old_which_leaves_the_engine_and_disk() -> None:
    engine = StandInEngine()
    manager = manager_of(engine)
    first, replaced = await load(manager, "policy", seed=1)
    assert (first.version, replaced) == (1, 0)
    second, replaced = await load(manager, "policy", seed=2)
    assert (second.version, replaced) == (2, 1)
    assert engine.removed == [first.vllm_id] and not first.path.exists()
    assert [(a.name, a.version) for a in manager.serving()] == [("policy", 2)]
    assert first.sha256 != second.sha256
    manager.close()


async def test_a_running_request_keeps_its_version_until_it_ends() -> None:
    engine = StandInEngine()
    manager = manager_of(engine)
    first, _ = await load(manager, "policy", seed=1)
    running = manager.begin("policy")
    assert running is first and first is not None
    await load(manager, "policy", seed=2)
    assert engine.removed == [] and first.path.exists()  # still generating on version 1
    manager.end(running)
    # The removal runs in the background.
    await until(lambda: engine.removed == [first.vllm_id], what="version 1's removal")
    assert manager.begin("") is None  # the base model
    manager.close()


async def test_a_refused_adapter_changes_nothing() -> None:
    engine = StandInEngine()
    manager = manager_of(engine)
    first, _ = await load(manager, "policy", seed=1)
    engine.accept = False
    with pytest.raises(InvalidArgument, match="refused adapter 'policy'"):
        await load(manager, "policy", seed=2)
    assert manager.serving() == [first] and list(engine.loaded) == [first.vllm_id]
    staged = [p for p in manager.staging_dir("x").parent.iterdir() if p.name.startswith("policy")]
    assert staged == [first.path]  # the refused version's staging copy is gone
    manager.close()


async def test_rules_are_refused_with_the_flag_to_change() -> None:
    engine = StandInEngine()
    manager = manager_of(engine, max_adapters=1)
    with pytest.raises(InvalidArgument, match="--max-lora-rank"):
        await load(manager, "big", seed=1, config={**CONFIG, "r": 8})
    with pytest.raises(InvalidArgument, match="not in the model"):
        await load(manager, "odd", seed=1, config={**CONFIG, "target_modules": ["w_proj"]})
    await load(manager, "one", seed=1)
    with pytest.raises(FailedPrecondition, match="--max-cpu-loras"):
        await load(manager, "two", seed=1)
    with pytest.raises(FailedPrecondition, match="not newer"):
        await load(manager, "one", seed=1, version=1)
    assert engine.removed == [] and len(engine.loaded) == 1
    manager.close()


async def test_a_server_without_lora_says_how_to_enable_it() -> None:
    engine = StandInEngine()
    manager = AdapterManager(
        AdapterLimits(False), None, EngineAdapterCalls(engine.add, engine.remove)
    )
    assert manager.begin("") is None and manager.serving() == []
    with pytest.raises(FailedPrecondition, match="--enable-lora"):
        manager.upload(AdapterSpec(name="x", config_json="{}"))
    with pytest.raises(NotFound, match="--enable-lora"):  # an unknown name, as with LoRA on
        manager.begin("x")
