"""The part of weight transfer that runs inside vLLM's worker processes.

vLLM mixes ``WeightTransferWorker`` into its Worker (engine argument ``worker_extension_cls``);
the server calls its ``skyrl_*`` methods through ``collective_rpc`` with the names and payloads
of ``protocol``, serialized without pickle: only plain values and bytes cross (tensors are
rebuilt from bytes here).

Received parameters are staged on the host; nothing touches the serving weights before
``skyrl_commit``. The worker keeps a host copy of the serving weights in checkpoint format (the
"shadow", first read from the model's safetensors files): a commit reloads shadow + staged as a
complete checkpoint, because vLLM fuses parameters (q/k/v, gate/up) and a partial reload would
reinitialise the fused halves it was not given. ``reload_weights`` re-runs vLLM's post-load
processing, which plain ``load_weights`` after start-up does not. If the reload fails, the shadow
(the previous weights) is loaded back. Checksums are computed from the shadow.

After a commit the previous shadow is kept (only the replaced tensors cost memory: the rest are
shared) until the next update starts, so ``skyrl_rollback`` can serve it again when another
server of the fleet failed to commit.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta
from typing import Any

from .finite import all_finite
from .protocol import (
    PATCH_INDEX_BYTES,
    Bucket,
    Checksum,
    Group,
    ParameterShape,
    Received,
    StagedParameter,
)

log = logging.getLogger(__name__)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _sha256_of(tensor: Any) -> bytes:
    """SHA-256 of a tensor's raw bytes (the checksums a trainer compares with its own)."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch_uint8()).numpy()).digest()


def _bits_of(itemsize: int) -> Any:
    """The integer type of an element size: a patch writes bits, never float values."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def receive_buckets(
    group: Any, buckets: list[Bucket], timeout_seconds: float, check_finite: bool = False
) -> tuple[dict[str, Any], int, list[str], list[str]]:
    """Receives ``buckets`` from rank 0 of ``group``.

    Returns the parameters as host tensors (views of their bucket: each bucket has a buffer of
    its own, so no copy), the bytes received and the names whose SHA-256 did not match. The
    receive of the next bucket is posted before the current one is sliced and verified, so
    checksumming overlaps the transfer.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = timedelta(seconds=timeout_seconds)

    def post(bucket: Bucket) -> tuple[Any, Any]:
        buffer = torch.empty(int(bucket["size"]), dtype=torch.uint8, device=device)
        return buffer, group.broadcast(buffer, 0)

    received: dict[str, Any] = {}
    mismatches: list[str] = []
    non_finite: list[str] = []
    total = 0
    pending = post(buckets[0]) if buckets else None
    for index, bucket in enumerate(buckets):
        assert pending is not None
        buffer, work = pending
        work.wait(timeout)
        pending = post(buckets[index + 1]) if index + 1 < len(buckets) else None
        host = buffer.cpu()
        total += host.numel()
        for param in bucket["params"]:
            start = int(param["offset"])
            dtype = getattr(torch, param["dtype"])
            count = 1
            for dim in param["shape"]:
                count *= int(dim)
            raw = host[start : start + count * dtype.itemsize]
            if param.get("sha256") and hashlib.sha256(raw.numpy()).digest() != param["sha256"]:
                mismatches.append(param["name"])
                continue
            if check_finite and not all_finite(raw.numpy(), param["dtype"]):
                non_finite.append(param["name"])
                continue
            received[param["name"]] = raw.view(dtype).reshape(param["shape"])
    return received, total, mismatches, non_finite


class WeightTransferWorker:
    """Mixin for vLLM's Worker. All state lives in ``_skyrl_*`` attributes."""

    # vLLM's Worker, which this class is mixed into, provides the model runner.
    model_runner: Any
    _skyrl_group: Any = None
    _skyrl_staged: dict[str, Any] | None = None
    _skyrl_shadow: dict[str, Any] | None = None
    # The shadow before the last commit, kept for a rollback until the next update starts.
    _skyrl_previous: dict[str, Any] | None = None
    _skyrl_timeout: float = 300.0

    def _skyrl_weights(self) -> dict[str, Any]:
        """The serving weights in checkpoint format (host tensors), loaded on first use."""
        if self._skyrl_shadow is None:
            from pathlib import Path

            from safetensors.torch import load_file

            model_dir = Path(self.model_runner.model_config.model)
            shadow: dict[str, Any] = {}
            for path in sorted(model_dir.glob("*.safetensors")):
                shadow.update(load_file(str(path), device="cpu"))
            if not shadow:
                raise RuntimeError(f"no safetensors weights in {model_dir} to update")
            self._skyrl_shadow = shadow
        return self._skyrl_shadow

    def skyrl_layout(self) -> dict[str, ParameterShape]:
        """Element type and shape of every checkpoint parameter."""
        return {
            name: ParameterShape(dtype=_dtype_name(t), shape=list(t.shape))
            for name, t in self._skyrl_weights().items()
        }

    def skyrl_checksums(self, names: list[str]) -> list[Checksum]:
        """SHA-256 of the serving weights (all when ``names`` is empty), sorted by name."""
        weights = self._skyrl_weights()
        result = []
        for name in names or sorted(weights):
            tensor = weights[name]
            digest = _sha256_of(tensor)
            result.append(
                Checksum(
                    name=name, sha256=digest, dtype=_dtype_name(tensor), shape=list(tensor.shape)
                )
            )
        return result

    def _skyrl_staging(self) -> dict[str, Any]:
        if self._skyrl_staged is None:
            self._skyrl_staged = {}
        return self._skyrl_staged

    def skyrl_join_group(self, group: Group) -> int:
        """Joins the trainer's group as ``rank_offset + this worker's rank``; returns the rank."""
        from skyrl_grpc.process_group import join_group

        rank = group["rank_offset"] + int(getattr(self, "rank", 0))
        self._skyrl_group = join_group(
            group["backend"],
            group["master_address"],
            group["master_port"],
            rank,
            group["world_size"],
            group["group_name"],
            group["timeout_seconds"],
        )
        self._skyrl_timeout = group["timeout_seconds"]
        return rank

    def skyrl_leave_group(self) -> None:
        """Drops the group (its connections close with it)."""
        self._skyrl_group = None

    def skyrl_receive_buckets(self, buckets: list[Bucket], check_finite: bool) -> Received:
        """Receives each bucket (validated by the server) by broadcast from rank 0 and stages
        its parameters.

        Every bucket is received even after a checksum mismatch or a non-finite value, so the
        trainer's broadcasts never hang; those are returned and nothing of this call is staged
        then.
        """
        if self._skyrl_group is None:
            raise RuntimeError("not in a weight-transfer group: call InitWeightTransfer first")
        received, total, mismatches, non_finite = receive_buckets(
            self._skyrl_group, buckets, self._skyrl_timeout, check_finite
        )
        if not mismatches and not non_finite:
            self._skyrl_staging().update(received)
        return Received(
            bytes=total, params=len(received), mismatches=mismatches, non_finite=non_finite
        )

    def skyrl_stage(self, params: list[StagedParameter]) -> list[str]:
        """Stages in-band parameters (already verified by the server). A patch is applied to
        the serving weights (bit for bit, as integers) and checked against its SHA-256;
        returns the names that did not match, and stages nothing of the call then."""
        import torch

        staged: dict[str, Any] = {}
        mismatches: list[str] = []
        for param in params:
            dtype = getattr(torch, param["dtype"])
            if param.get("patch"):
                tensor = self._skyrl_patched(param, dtype)
                expected = param.get("sha256", b"")
                if expected and _sha256_of(tensor) != expected:
                    mismatches.append(param["name"])
                staged[param["name"]] = tensor
                continue
            # One copy, into memory torch may keep writable.
            buffer = bytearray().join(param["chunks"])
            staged[param["name"]] = torch.frombuffer(buffer, dtype=dtype).reshape(param["shape"])
        if not mismatches:
            self._skyrl_staging().update(staged)
        return mismatches

    def _skyrl_patched(self, param: StagedParameter, dtype: Any) -> Any:
        """The serving value of ``param`` with its patch applied."""
        import numpy as np
        import torch

        changed = int(param["patch"])
        payload = b"".join(param["chunks"])
        indices = torch.from_numpy(
            np.frombuffer(payload, dtype="<u4", count=changed).astype(np.int64)
        )
        base = self._skyrl_staging().get(param["name"])
        if base is None:
            base = self._skyrl_weights()[param["name"]]
        as_bits = _bits_of(dtype.itemsize)
        tensor = base.clone()
        values = torch.frombuffer(bytearray(payload[changed * PATCH_INDEX_BYTES :]), dtype=as_bits)
        tensor.view(-1).view(as_bits)[indices] = values
        return tensor

    def skyrl_discard(self) -> int:
        count = len(self._skyrl_staging())
        self._skyrl_staged = {}
        return count

    def skyrl_commit(self) -> int:
        """Loads the staged parameters (completed by the shadow) into the serving model."""
        staged = self._skyrl_staging()
        if not staged:
            return 0
        previous = self._skyrl_weights()
        merged = {**previous, **staged}
        try:
            self.model_runner.reload_weights(weights_iterator=iter(merged.items()))
        except Exception:
            log.exception("reloading the new weights failed; restoring the previous ones")
            self.model_runner.reload_weights(weights_iterator=iter(previous.items()))
            self._skyrl_staged = {}
            raise
        self._skyrl_previous = previous
        self._skyrl_shadow = merged
        self._skyrl_staged = {}
        return len(staged)

    def skyrl_rollback(self) -> int:
        """Serves the weights from before the last commit again."""
        previous = self._skyrl_previous
        if previous is None:
            raise RuntimeError("no previous weights kept: nothing to roll back")
        current = self._skyrl_weights()
        self.model_runner.reload_weights(weights_iterator=iter(previous.items()))
        self._skyrl_shadow = previous
        self._skyrl_previous = None
        return sum(1 for name, tensor in previous.items() if current.get(name) is not tensor)

    def skyrl_release_rollback(self) -> None:
        self._skyrl_previous = None

    def skyrl_clear_kv_cache(self) -> int:
        """Zeroes every KV cache tensor; returns the bytes cleared. Only while no request holds
        KV: non-finite values left in a block by non-finite weights reach the next requests
        that get that block (attention reads whole blocks, and 0 x NaN is NaN)."""
        cleared = 0
        for tensor in self.model_runner.kv_caches:
            tensor.zero_()
            cleared += tensor.numel() * tensor.element_size()
        return cleared
