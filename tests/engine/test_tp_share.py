"""Tensor-parallel ranks reloading together (``servers.engine.worker.tp_share``), over a real
gloo group of two processes, without vLLM: the other rank reads TP rank 0's copy in shared memory
where it can (``shared_copy``), and is sent it where it cannot; a rank that fails mid-reload,
wherever it fails, releases the other instead of leaving it waiting in a broadcast; both then
agree the reload failed, and the group serves the next one."""

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
# How rank 0 offers its copy: not in shared memory (streamed), in shared memory the other rank
# reads, or at a path the other rank cannot open (then streamed too).
MODES = ["streamed", "shared", "unreadable"]


def _rank(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from servers.engine.worker.shared_copy import SharedCopy, layout_of
    from servers.engine.worker.tp_share import Row, StreamAborted, TensorParallelShare

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    share = TensorParallelShare((2, rank, 0, None))
    plain = {n: torch.full((4, 3), float(i)) for i, n in enumerate(NAMES)}
    copy = SharedCopy(layout_of(plain))
    in_shared = {n: copy.value(n, 1).copy_(t) for n, t in plain.items()}
    for mode in MODES:
        weights, plan, path = None, None, ""
        if rank == 0:
            weights = plain if mode == "streamed" else in_shared
            plan = [Row(n, "float32", [4, 3], copy.offset_of(weights[n])) for n in NAMES]
            path = {"streamed": "", "shared": copy.path, "unreadable": "/nonexistent"}[mode]
        for scenario in SCENARIOS:
            got: list[float] = []
            ok, aborted = True, False
            try:
                stream = share.stream(share.agree(plan, path), weights)
                for index, (_, tensor) in enumerate(stream):
                    if scenario == (rank, index):
                        raise RuntimeError("this rank's reload failed")
                    got.append(float(tensor.sum()))
                if scenario == (rank, "after"):
                    raise RuntimeError("this rank failed after the stream")
            except StreamAborted:
                ok, aborted = False, True
            except RuntimeError:
                ok = False
            results.put((rank, mode, scenario, share.outcome(ok), aborted, got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[int, str, Any], tuple[bool, bool, list[float]]]:
    """What each rank saw in each mode and scenario: (agreed outcome, aborted, tensor sums)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port("127.0.0.1")
    ranks = [context.Process(target=_rank, args=(r, port, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    seen: dict[tuple[int, str, Any], tuple[bool, bool, list[float]]] = {}
    try:
        for _ in range(2 * len(MODES) * len(SCENARIOS)):
            rank, mode, scenario, agreed, aborted, got = results.get(timeout=120)
            seen[rank, mode, scenario] = (agreed, aborted, got)
    except queue.Empty:
        pytest.fail(f"a rank hung; outcomes so far: {seen}")
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return seen


@pytest.mark.parametrize("mode", ["streamed", "unreadable"])
def test_a_rank_that_fails_mid_stream_releases_the_other_and_both_agree(
    outcomes: dict[tuple[int, str, Any], tuple[bool, bool, list[float]]], mode: str
) -> None:
    def outcome(rank: int, scenario: Any) -> tuple[bool, bool, list[float]]:
        return outcomes[rank, mode, scenario]

    whole = [0.0, 12.0, 24.0]  # each tensor's sum: both ranks see the holder's tensors
    assert outcome(0, None) == outcome(1, None) == (True, False, whole)
    # The peer fails on the second tensor: the holder stops before the third, aborted.
    assert outcome(1, (1, 1)) == (False, False, [0.0])
    assert outcome(0, (1, 1)) == (False, True, [0.0, 12.0])
    # The holder fails: the peer stops, aborted.
    assert outcome(0, (0, 1)) == (False, False, [0.0])
    assert outcome(1, (0, 1)) == (False, True, [0.0, 12.0])
    assert outcome(1, (1, 0))[0] is outcome(0, (1, 0))[0] is False
    # A failure after the whole stream: the other finished it, and still learns of it.
    assert outcome(1, (1, "after")) == (False, False, whole)
    assert outcome(0, (1, "after")) == (False, False, whole)


def test_with_a_shared_copy_the_other_rank_reads_it_and_failures_still_agree(
    outcomes: dict[tuple[int, str, Any], tuple[bool, bool, list[float]]],
) -> None:
    """Nothing is streamed: each rank goes through every tensor on its own, so a failing rank
    does not stop the other mid-way, but both learn of it after the last tensor."""

    def outcome(rank: int, scenario: Any) -> tuple[bool, bool, list[float]]:
        return outcomes[rank, "shared", scenario]

    whole = [0.0, 12.0, 24.0]  # read from rank 0's shared memory by the other rank
    assert outcome(0, None) == outcome(1, None) == (True, False, whole)
    assert outcome(1, (1, 1)) == (False, False, [0.0])
    assert outcome(0, (1, 1)) == (False, True, whole)
    assert outcome(0, (0, 1)) == (False, False, [0.0])
    assert outcome(1, (0, 1)) == (False, True, whole)
    assert outcome(1, (1, 0))[0] is outcome(0, (1, 0))[0] is False
    assert outcome(1, (1, "after")) == (False, False, whole)
    assert outcome(0, (1, "after")) == (False, False, whole)
