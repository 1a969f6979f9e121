"""One weight update, decided before a byte moves: the servers, the version, what each server
serves and takes, how the bytes travel. ``weight_updates`` makes the plan once from the
fleet's answers (``make_plan``); ``weight_delivery`` sends by it; ``PushedWeights`` is what
this client last committed, the base of the next update's patches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerState:
    """What one server said before the update: the version it serves, whether it takes
    compressed patches (an older server does not), the rendezvous (address, port) of the
    collective group it is in (None: none, as after a restart), whether it relays updates down
    relay trees and takes streams of several manifests (``relay_plan``; an older server does
    not) and its push socket's port (0: none)."""

    version: int
    takes_compressed: bool
    group: tuple[str, int] | None = None
    relays: bool = False
    push_socket_port: int = 0


# What a server gets of an update: (patches, compressed) — patches against the plan's base
# (compressed or not), or the whole values.
Variant = tuple[bool, bool]
PATCHES: Variant = (True, False)
COMPRESSED: Variant = (True, True)
WHOLE: Variant = (False, False)


@dataclass(frozen=True)
class Sending:
    """How the bytes travel: chunk (in-band) and bucket (collective) sizes, whether every
    parameter's SHA-256 goes along, the transfer's deadline."""

    chunk_bytes: int | None  # None: the client's choice (``weight_delivery.chunk_bytes_for``)
    bucket_bytes: int
    checksums: bool
    timeout: float


@dataclass(frozen=True)
class UpdatePlan:
    """One update: ``version`` on ``servers``, over the collective group or in-band; patches
    against ``base`` to each server serving its version (compressed to those in
    ``compressing``), the whole weights to the others."""

    servers: tuple[str, ...]
    version: int
    collective: bool
    base: PushedWeights | None
    serving: Mapping[str, int]  # the version each server that answered serves
    compressing: frozenset[str]
    sending: Sending

    def patched(self, address: str) -> bool:
        """Whether ``address`` gets patches (it serves the base's version)."""
        return self.base is not None and self.serving.get(address) == self.base.version

    def all_patched(self, addresses: Sequence[str]) -> bool:
        return all(self.patched(a) for a in addresses)

    def variant(self, address: str) -> Variant:
        """What ``address`` gets: patches (compressed where the plan says), or whole values."""
        if not self.patched(address):
            return WHOLE
        return COMPRESSED if address in self.compressing else PATCHES


async def make_plan(
    servers: Sequence[str],
    weight_version: int | None,
    base: PushedWeights | None,
    *,
    collective: bool,
    compress: bool,
    sending: Sending,
    state: Callable[[str], Awaitable[ServerState]],
) -> UpdatePlan:
    """The plan, asking each server's ``state`` once. A server that does not answer is left
    out of ``serving`` (it gets the whole weights, or fails the update at its start, where the
    error reports every server)."""
    answers = await asyncio.gather(*(state(a) for a in servers), return_exceptions=True)
    states = {a: s for a, s in zip(servers, answers, strict=True) if isinstance(s, ServerState)}
    serving = {a: s.version for a, s in states.items()}
    compressing: frozenset[str] = frozenset()
    if compress and base is not None:
        compressing = frozenset(a for a, s in states.items() if s.takes_compressed)
        if set(servers) - compressing:
            log.info(
                "%s do not take compressed patches: they get theirs uncompressed",
                ", ".join(sorted(set(servers) - compressing)),
            )
    return UpdatePlan(
        servers=tuple(servers),
        version=weight_version or 1 + max(serving.values(), default=0),
        collective=collective,
        base=base,
        serving=serving,
        compressing=compressing,
        sending=sending,
    )


@dataclass
class PushedWeights:
    """The tensors this client last committed in-band, as ``version`` (copies, on their
    device): what the next update's patches are computed against."""

    version: int
    tensors: dict[str, Any]

    @staticmethod
    def after(
        previous: PushedWeights | None,
        version: int,
        pushed: list[tuple[str, Any]],
        reserved: Mapping[str, Any] | None = None,
    ) -> PushedWeights:
        """The record once ``pushed`` committed as ``version``: the previous record's tensors
        (parameters not pushed this time are unchanged on the servers) with the pushed ones
        copied in. A copy goes into the previous record's tensor of the same shape, type and
        device (the previous record is dropped), or else into the ``reserved`` one
        (``reserve_record``): no second copy of the model, no fresh memory to fault in every
        step. Only a tensor with neither is cloned."""
        tensors = dict(previous.tensors) if previous is not None else {}
        spare = reserved or {}
        for name, tensor in pushed:
            source = tensor.detach()
            kept = tensors.get(name)
            if kept is None or not _fits(kept, source):
                kept = spare.get(name)
            if kept is not None and _fits(kept, source):
                kept.copy_(source)
                tensors[name] = kept
            else:
                tensors[name] = source.clone()
        return PushedWeights(version, tensors)


def reserve_record(named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Memory for a first record, touched now (zeroed): one tensor like each of
    ``named_tensors``, on its device. Its values are never a base: only ``after`` writes into
    it, and only the tensors it copies there become the record."""
    import torch

    return {name: torch.zeros_like(tensor.detach()) for name, tensor in named_tensors}


def _fits(kept: Any, source: Any) -> bool:
    return bool(
        kept.shape == source.shape and kept.dtype == source.dtype and kept.device == source.device
    )
