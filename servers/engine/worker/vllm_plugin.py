"""Registers this project's weight-transfer engine with vLLM's factory.

A vLLM general plugin (entry point ``vllm.general_plugins`` in ``pyproject.toml``): vLLM runs it
in every process it starts (engine core, workers) before the workers create their engine, so
``weight_transfer_config={"backend": "skyrl"}`` resolves there. Registered by module path:
nothing of vLLM's weight path is imported until an engine is created.
"""

from __future__ import annotations

ENGINE_MODULE = "servers.engine.worker.transfer_engine"
ENGINE_CLASS = "SkyrlWeightTransferEngine"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from servers.engine.transfer.protocol import BACKEND

    if BACKEND not in WeightTransferEngineFactory._registry:  # plugins may run more than once
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
