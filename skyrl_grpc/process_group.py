"""Joining the weight-transfer process group, the same way on both sides.

The trainer is rank 0 and hosts the rendezvous store; each server's workers are ranks
``rank_offset .. rank_offset + world_size_of_server - 1``. A ``PrefixStore`` keyed by the group
name lets several groups share one store. Both sides block in the constructor until every rank
has joined, so the trainer must join concurrently with the servers' InitWeightTransfer calls.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def join_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_seconds: float,
) -> Any:
    """Returns a torch process group (gloo or nccl) with ``rank`` in ``world_size``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"skyrl-weights/{group_name}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"unknown process-group backend {backend!r}")
