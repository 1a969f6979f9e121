"""LoRA adapters on an engine server: ``checks`` (what an adapter must be to load), ``upload``
(one LoadLoraAdapter stream), ``registry`` (versions and engine ids) and ``manager`` (the
whole load / swap / remove path, over plain engine callables)."""

from servers.engine.domain.lora_adapters.checks import (
    ZERO_ADAPTER_ID,
    AdapterConfig,
    ModelShapes,
    write_zero_adapter,
)
from servers.engine.domain.lora_adapters.manager import (
    AdapterLimits,
    AdapterManager,
    EngineAdapterCalls,
)
from servers.engine.domain.lora_adapters.registry import LoadedAdapter
from servers.engine.domain.lora_adapters.upload import AdapterCopy, AdapterSpec, AdapterUpload

__all__ = [
    "ZERO_ADAPTER_ID",
    "AdapterConfig",
    "AdapterCopy",
    "AdapterLimits",
    "AdapterManager",
    "AdapterSpec",
    "AdapterUpload",
    "EngineAdapterCalls",
    "LoadedAdapter",
    "ModelShapes",
    "write_zero_adapter",
]
