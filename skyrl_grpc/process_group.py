"""Joining the weight-transfer process group, the same way on both sides.

The trainer is rank 0 and hosts the rendezvous store; each server's workers are ranks
``rank_offset .. rank_offset + world_size_of_server - 1``. A ``PrefixStore`` keyed by the group
name lets several groups share one store. Both sides block until every rank has joined, so the
trainer must join concurrently with the servers' InitWeightTransfer calls.

torch's own rendezvous (inside the process-group constructor) cannot be interrupted: a rank
that never comes (a server that refused to join) keeps every other rank blocked for the whole
timeout, holding the trainer's port. So the ranks first meet in the store, where each one
polls: every rank writes ``arrived/<rank>`` and waits until all have; any rank may write
``abort`` (the trainer does when a server refused, or when its caller gives up), and every
waiting rank then fails at once. Only when all have arrived is the process group built, which
then completes promptly.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

# How often a waiting rank looks at the store (one round trip each).
POLL_SECONDS = 0.05
ABORT_KEY = "abort"


class JoinAborted(RuntimeError):
    """The rendezvous was given up: a rank aborted it, or it timed out."""


def join_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_seconds: float,
    cancel: threading.Event | None = None,
    store: Any = None,
) -> Any:
    """Returns a torch process group (gloo or nccl) with ``rank`` in ``world_size``.

    ``cancel``: setting it from another thread makes this join (and every other rank's) give
    up with ``JoinAborted``. ``store``: rank 0's store from ``master_store``, which its caller
    keeps open until the other ranks have seen an abort (a rank still connecting to a store
    that is gone retries for the whole timeout); without it, a store of its own.
    """
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown process-group backend {backend!r}")
    timeout = timedelta(seconds=timeout_seconds)
    if store is None:
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    prefixed: Any = dist.PrefixStore(f"skyrl-weights/{group_name}", store)
    failure: str | None = None
    try:
        _meet(prefixed, rank, world_size, timeout_seconds, cancel)
    except Exception as error:
        failure = str(error)
        if not isinstance(error, JoinAborted):
            failure = f"{type(error).__name__}: {failure}"
    if failure is not None:
        # Raised outside the handler, and with the store dropped: a traceback that kept these
        # frames would keep the store, and rank 0's listening port, alive.
        store = prefixed = None
        raise JoinAborted(failure)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def master_store(
    master_address: str, master_port: int, world_size: int, timeout_seconds: float
) -> Any:
    """Rank 0's rendezvous store, listening on ``master_port`` until it is dropped."""
    import torch.distributed as dist

    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_seconds),
        wait_for_workers=False,
    )


def _meet(
    store: Any, rank: int, world_size: int, timeout_seconds: float, cancel: threading.Event | None
) -> None:
    """Waits until every rank has arrived, or fails as soon as any rank aborts."""
    store.set(f"arrived/{rank}", "1")
    everyone = [f"arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_seconds
    while not store.check(everyone):
        if store.check([ABORT_KEY]):
            raise JoinAborted(f"the rendezvous was aborted: {store.get(ABORT_KEY).decode()}")
        if cancel is not None and cancel.is_set():
            store.set(ABORT_KEY, f"rank {rank} gave up")
            raise JoinAborted(f"rank {rank} gave up the rendezvous")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
            store.set(ABORT_KEY, f"rank {rank} timed out waiting for ranks {missing}")
            raise JoinAborted(
                f"ranks {missing} did not join within {timeout_seconds:.0f} s (rank {rank})"
            )
        time.sleep(POLL_SECONDS)


def free_port(host: str) -> int:
    """A port free on ``host`` now (for the group's master store)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
