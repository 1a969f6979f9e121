"""Tensor-parallel ranks reloading in lockstep (``servers.engine.weights.tp_share``), over a
real gloo group of two processes, without vLLM: TP rank 0 streams its copy to the other rank,
and a rank that fails mid-reload, wherever it fails, releases the other instead of leaving it
waiting in a broadcast; both then agree the reload failed, and the group serves the next one."""

from __future__ import annotations

import multiprocessing
import queue
from datetime import timedelta
from typing import Any

import pytest

from skyrl_grpc.process_group import free_port

# (the failing rank, where it fails: the index of the tensor it fails on, or "after" the
# stream), or None: nothing fails.
SCENARIOS: list[tuple[int, int | str] | None] = [None, (1, 1), (0, 1), (1, 0), (1, "after")]
NAMES = ["a", "b", "c"]


def _rank(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from servers.engine.weights.tp_share import StreamAborted, TensorParallelShare

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    share = TensorParallelShare((2, rank, 0, None))
    weights = {n: torch.full((4, 3), float(i)) for i, n in enumerate(NAMES)} if rank == 0 else None
    plan = [(n, "float32", [4, 3]) for n in NAMES] if rank == 0 else None
    for scenario in SCENARIOS:
        got: list[float] = []
        ok, aborted = True, False
        try:
            for index, (_, tensor) in enumerate(share.stream(share.agree(plan), weights)):
                if scenario == (rank, index):
                    raise RuntimeError("this rank's reload failed")
                got.append(float(tensor.sum()))
            if scenario == (rank, "after"):
                raise RuntimeError("this rank failed after the stream")
        except StreamAborted:
            ok, aborted = False, True
        except RuntimeError:
            ok = False
        results.put((rank, scenario, share.outcome(ok), aborted, got))
    dist.destroy_process_group()


def test_a_rank_that_fails_mid_reload_releases_the_other_and_both_agree() -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port("127.0.0.1")
    ranks = [context.Process(target=_rank, args=(r, port, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    outcomes: dict[tuple[int, Any], tuple[bool, bool, list[float]]] = {}
    try:
        for _ in range(2 * len(SCENARIOS)):
            rank, scenario, agreed, aborted, got = results.get(timeout=120)
            outcomes[rank, scenario] = (agreed, aborted, got)
    except queue.Empty:
        pytest.fail(f"a rank hung; outcomes so far: {outcomes}")
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    whole = [0.0, 12.0, 24.0]  # each tensor's sum: both ranks see the holder's tensors
    assert outcomes[0, None] == outcomes[1, None] == (True, False, whole)
    # The peer fails on the second tensor: the holder stops before the third, aborted.
    assert outcomes[1, (1, 1)] == (False, False, [0.0])
    assert outcomes[0, (1, 1)] == (False, True, [0.0, 12.0])
    # The holder fails: the peer stops, aborted.
    assert outcomes[0, (0, 1)] == (False, False, [0.0])
    assert outcomes[1, (0, 1)] == (False, True, [0.0, 12.0])
    assert outcomes[1, (1, 0)][0] is outcomes[0, (1, 0)][0] is False
    # A failure after the whole stream: the other finished it, and still learns of it.
    assert outcomes[1, (1, "after")] == (False, False, whole)
    assert outcomes[0, (1, "after")] == (False, False, whole)
