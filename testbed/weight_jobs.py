"""The weight jobs of ``testbed.jobs``: ``update`` (a trainer's weight updates, timed, each
server's checksums after) and ``checksums`` (each server's weights and version)."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from testbed.job_io import client_settings, progress

# The share of each tensor's elements an edit changes: an RL step's patch.
EDIT_SHARE = 0.01
# A failed weight update a trainer tries again (a step's ``retry_seconds``): after this long.
RETRY_UPDATE_SECONDS = 1.0
# How long a step waits for its cue (``wait_for``) at most.
WAIT_FOR_SECONDS = 300.0


def edited(original: dict[str, Any], edit: int) -> dict[str, Any]:
    """The checkpoint after ``edit`` edits (0: itself), each changing a seeded 1% of every
    tensor's elements by a small amount: deterministic, so any host makes the same weights."""
    import torch

    weights = dict(original)
    for step in range(1, edit + 1):
        generator = torch.Generator().manual_seed(step)
        for name, tensor in weights.items():
            changed = torch.rand(tensor.shape, generator=generator) < EDIT_SHARE
            weights[name] = torch.where(changed, tensor + 1e-3 * step, tensor)
    return weights


def _hex(sums: dict[str, dict[str, bytes]]) -> dict[str, dict[str, str]]:
    return {s: {n: v.hex() for n, v in by.items()} for s, by in sums.items()}


async def _commit_seconds(servers: list[str], tls: Any) -> dict[str, float]:
    """Each server's last update's commit (its reload into vLLM), as its status stream says."""
    from skyrl_grpc.channels import open_channel
    from skyrl_grpc.v1 import status_pb2, status_pb2_grpc

    seconds = {}
    for address in servers:
        async with open_channel(address, tls=tls) as channel:
            stream = status_pb2_grpc.ServerStatusStub(channel).Watch(status_pb2.WatchRequest())
            first = await anext(aiter(stream))
            stream.cancel()
        if first.recent_updates:
            seconds[address] = first.recent_updates[-1].phase_seconds.get("commit", 0.0)
    return seconds


async def _versions(client: Any) -> dict[str, int | None]:
    """Each server's weight version; None for one that does not answer (dead, cut off)."""
    from trainer_client import FanOutError

    try:
        return dict(await client.weight_versions())
    except FanOutError as partly:
        return {**dict.fromkeys(partly.failures), **partly.results}


async def _appears(path: Path, seconds: float) -> None:
    """Returns once ``path`` exists; raises after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await asyncio.to_thread(path.exists):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:.0f} s")
        await asyncio.sleep(0.1)


async def update(arguments: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    from skyrl_grpc.tensor_bytes import sha256_of
    from trainer_client import InferenceClient, WeightUpdateError

    servers: list[str] = arguments["servers"]
    model = Path(arguments["model"])
    original = load_file(str(model / "model.safetensors"))
    client = InferenceClient(servers[0], servers, direct=False, **client_settings(arguments))
    versions = await _versions(client)
    version = max(v for v in versions.values() if v is not None) + 1
    steps: list[dict[str, Any]] = []
    weights = original
    try:
        for step in arguments["steps"]:
            weights = edited(original, step.get("edit", 0))
            progress(f"step {len(steps)} begins")
            if "wait_for" in step:  # the step begins once this file exists (the caller's cue)
                await _appears(Path(step["wait_for"]), WAIT_FOR_SECONDS)
            began = time.monotonic()
            # A trainer's step: generation paused around the update.
            paused = await client.pause("abort") if step.get("pause") else None
            # A trainer's retry: a step that fails is tried again every second for this long.
            retry_until = began + float(step.get("retry_seconds", 0))
            tries = 0
            while True:
                tries += 1
                try:
                    result = await client.update_weights(
                        weights.items(), version, delta=step.get("delta", True),
                        **step.get("update", arguments.get("update", {})),
                    )  # fmt: skip
                    break
                except WeightUpdateError as error:
                    failure = str(error)
                    if time.monotonic() < retry_until:
                        await asyncio.sleep(RETRY_UPDATE_SECONDS)
                        continue
                    result = None
                    break
            if result is None:
                ended = time.monotonic()
                steps.append(
                    {"error": failure, "seconds": ended - began, "began": began, "ended": ended}
                )
                if arguments.get("keep_going"):  # the trainer goes on with its next step
                    continue
                break
            resumed = await client.resume() if paused is not None else None
            ended = time.monotonic()
            record: dict[str, Any] = {
                "tries": tries,
                "seconds": ended - began,
                # On the host's monotonic clock, which every host of a testbed shares.
                "began": began,
                "ended": ended,
                "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received,
                "relayed": result.relayed,
                "versions": {a: c.weight_version for a, c in result.items()},
                "phases": dict(result.phases),  # where the trainer waited
            }
            if result.cut_out:
                record["cut_out"] = result.cut_out
            if paused is not None:
                record["paused"], record["resumed"] = paused, resumed
            record["commit_seconds"] = await _commit_seconds(list(result), client.config.tls)
            if step.get("checksums", arguments.get("checksums", True)):
                record["served"] = _hex(await client.weight_checksums())
                record["pushed"] = {n: sha256_of(t).hex() for n, t in weights.items()}
            steps.append(record)
            version += 1
        out: dict[str, Any] = {"steps": steps, "versions": await _versions(client)}
        if arguments.get("save"):
            saved = Path(arguments["save"])
            shutil.copytree(model, saved, dirs_exist_ok=True)
            save_file(
                {n: t.contiguous() for n, t in weights.items()}, str(saved / "model.safetensors")
            )
        return out
    finally:
        await client.close()


async def checksums(arguments: dict[str, Any]) -> dict[str, Any]:
    from trainer_client import InferenceClient

    servers: list[str] = arguments["servers"]
    client = InferenceClient(servers[0], servers, direct=False)
    try:
        return {
            "versions": dict(await client.weight_versions()),
            "checksums": _hex(await client.weight_checksums()),
        }
    finally:
        await client.close()
