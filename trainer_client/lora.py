"""LoRA adapters on every server of the fleet: load (in-band or from a path), unload, list."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.client_core import ClientCore
from trainer_client.config import DEFAULT, Timeout
from trainer_client.fanout import fan_out
from trainer_client.fleet_info import LoraAdapter, ServerInfo, refuse_unless_all
from trainer_client.weights.weight_sending import DEFAULT_CHUNK_BYTES, lora_push_messages


class Adapters:
    """LoRA calls (``InferenceClient.adapters``); ``timeout`` as in ``FleetControl``."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core

    async def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        config: Mapping[str, Any] | None = None,
        version: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: Timeout = DEFAULT,
    ) -> dict[str, LoraAdapter]:
        """Loads adapter ``name`` on every server at once: in-band (``tensors``, PEFT names,
        e.g. a PEFT model's ``get_peft_model_state_dict``, and ``config``, its
        adapter_config.json as a dict; no shared filesystem) or from ``path``, a directory on
        each server. Loading a name again replaces it with a new version (``version``; 0: the
        next). Raises FanOutError naming the servers that refused it; they keep what they
        served."""
        spec = cp.LoraAdapterSpec(name=name, version=version)
        if path is not None:
            if tensors is not None or config is not None:
                raise ValueError("pass path, or tensors and config, not both")
            spec.path = path
            messages = [cp.LoadLoraAdapterRequest(spec=spec)]
        else:
            if tensors is None or config is None:
                raise ValueError("an in-band adapter needs tensors and config (or pass path)")
            spec.config_json = json.dumps(dict(config))
            pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
            messages = [cp.LoadLoraAdapterRequest(spec=spec)]
            messages += lora_push_messages(pairs, chunk_bytes)
        core = self._core
        deadline = core.deadline("control", timeout)
        info = cp.GetServerInfoRequest()
        infos = await core.fan_out(lambda s: s.GetServerInfo, info, timeout, ServerInfo.from_proto)
        refuse_unless_all("load_lora", infos, lambda i: i.capabilities.cannot_load_lora())

        async def load(address: str) -> LoraAdapter:
            call = core.control(address).LoadLoraAdapter
            response = await core.unary(address, call, iter(messages), deadline, plane="control")
            return LoraAdapter.from_proto(response.adapter)

        return await fan_out("LoadLoraAdapter", await core.control_servers(), load)

    async def unload_lora(self, name: str, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Unloads adapter ``name`` everywhere; returns each server's last version of it."""
        request = cp.UnloadLoraAdapterRequest(name=name)
        return await self._core.fan_out(
            lambda s: s.UnloadLoraAdapter, request, timeout, lambda r: r.version
        )

    async def list_loras(self, *, timeout: Timeout = DEFAULT) -> dict[str, list[LoraAdapter]]:
        """Each server's loaded adapters, with versions and checksums."""
        request = cp.ListLoraAdaptersRequest()
        return await self._core.fan_out(
            lambda s: s.ListLoraAdapters,
            request,
            timeout,
            lambda r: [LoraAdapter.from_proto(x) for x in r.adapters],
        )
