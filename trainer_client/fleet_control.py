"""The control plane of the client: pause, resume, sleep, wake, cache reset, server info and
load, each fanned out to every server at once (``ClientCore.fan_out``: all answer, or
``FanOutError`` names those that failed and carries the others' answers)."""

from __future__ import annotations

from collections.abc import Sequence

from skyrl_grpc.v1 import control_plane_pb2 as cp
from trainer_client.client_core import ClientCore
from trainer_client.config import DEFAULT, Timeout
from trainer_client.fleet_info import PauseMode, ServerInfo, ServerLoad, refuse_unless_all


class FleetControl:
    """Fleet-wide control calls (``InferenceClient.fleet``). Calls that change state return
    the servers that did it, in the client's order; ``timeout``: seconds per server (None: no
    deadline; ``DEFAULT``: ``ClientConfig.control_timeout``)."""

    def __init__(self, core: ClientCore) -> None:
        self._fan_out = core.fan_out
        self._cut_out = core.config.cut_out_unreachable

    async def pause(
        self,
        mode: PauseMode | str = PauseMode.ABORT,
        clear_cache: bool = False,
        *,
        timeout: Timeout = DEFAULT,
        wait_for_starting: float = 120.0,
    ) -> list[str]:
        """Pauses every server; returns once all are paused. ``mode``: what running
        generations do (``PauseMode``: abort, wait or keep). ``wait_for_starting``: seconds
        to wait first for a server up but still starting (restarted or added: warming up,
        catching up with its peers), so it is paused too instead of failing the call. With
        ``ClientConfig.cut_out_unreachable``, a server that cannot be reached is cut out
        (``trainer_client.cut_out``) and left out of the servers returned."""
        try:
            pause_mode = PauseMode(mode)
        except ValueError:
            modes = ", ".join(m.value for m in PauseMode)
            raise ValueError(f"mode {mode!r}: use one of {modes}") from None
        request = cp.PauseRequest(mode=pause_mode.to_proto(), clear_cache=clear_cache)
        paused = await self._fan_out(
            lambda stub: stub.Pause,
            request,
            timeout,
            _nothing,
            wait_for_starting,
            cut_out=self._cut_out,
        )
        return list(paused)

    async def resume(
        self, *, timeout: Timeout = DEFAULT, wait_for_starting: float = 120.0
    ) -> list[str]:
        """Lets every server generate again (``wait_for_starting`` and the cut-out as
        ``pause``'s)."""
        request = cp.ResumeRequest()
        resumed = await self._fan_out(
            lambda s: s.Resume, request, timeout, _nothing, wait_for_starting, cut_out=self._cut_out
        )
        return list(resumed)

    async def is_paused(self, *, timeout: Timeout = DEFAULT) -> dict[str, bool]:
        request = cp.IsPausedRequest()
        return await self._fan_out(lambda s: s.IsPaused, request, timeout, lambda r: r.paused)

    async def all_paused(self, *, timeout: Timeout = DEFAULT) -> bool:
        return all((await self.is_paused(timeout=timeout)).values())

    async def sleep(self, level: int = 1, *, timeout: Timeout = DEFAULT) -> list[str]:
        """Puts every server to sleep; refused before any is (``Unsupported``) where one has no
        sleep mode, so a fleet is never left half asleep."""
        infos = await self.server_info(timeout=timeout)
        refuse_unless_all("sleep", infos, lambda i: i.capabilities.cannot_sleep(i.device))
        request = cp.SleepRequest(level=level)
        return list(await self._fan_out(lambda s: s.Sleep, request, timeout, _nothing))

    async def wake_up(self, tags: Sequence[str] = (), *, timeout: Timeout = DEFAULT) -> list[str]:
        request = cp.WakeUpRequest(tags=list(tags))
        return list(await self._fan_out(lambda s: s.WakeUp, request, timeout, _nothing))

    async def is_sleeping(self, *, timeout: Timeout = DEFAULT) -> dict[str, bool]:
        request = cp.IsSleepingRequest()
        return await self._fan_out(lambda s: s.IsSleeping, request, timeout, lambda r: r.sleeping)

    async def reset_prefix_cache(self, *, timeout: Timeout = DEFAULT) -> list[str]:
        request = cp.ResetPrefixCacheRequest()
        return list(await self._fan_out(lambda s: s.ResetPrefixCache, request, timeout, _nothing))

    async def server_info(self, *, timeout: Timeout = DEFAULT) -> dict[str, ServerInfo]:
        request = cp.GetServerInfoRequest()
        return await self._fan_out(
            lambda s: s.GetServerInfo, request, timeout, ServerInfo.from_proto
        )

    async def server_loads(self, *, timeout: Timeout = DEFAULT) -> dict[str, ServerLoad]:
        """How busy each server is now."""
        request = cp.GetLoadRequest()
        return await self._fan_out(lambda s: s.GetLoad, request, timeout, ServerLoad.from_proto)

    async def world_size(self, *, timeout: Timeout = DEFAULT) -> int:
        """Devices across the fleet: the sum of every server's world size."""
        infos = await self.server_info(timeout=timeout)
        return sum(info.world_size for info in infos.values())


def _nothing(response: object) -> None:
    """For calls whose answer says nothing but that they succeeded."""
