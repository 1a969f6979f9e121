"""What the weight benchmarks share: the benchmark model, built on the spot with the project's
own builder (``skyrl_grpc.tiny_model``; ~294M parameters, or ~94M with ``size="94m"``) and read
back, engine servers started as processes on it, and a trainer's steps on it (perturbations,
Adam on random gradients)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from scripts.bench_common import tree_memory

ROOT = Path(__file__).resolve().parents[1]

GiB = 1 << 30
# The weight benchmarks' models: hidden 2048, 8 layers, 16 heads / 4 KV heads (~294M
# parameters), at hidden 1024, intermediate 2816 (~94M), and at hidden 512 (~27M).
MODELS = {
    "294m": dict(
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "94m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    # The 94M one's bytes as a mixture of experts in Mixtral's architecture: each layer's MLP
    # split into 4 experts of a quarter of its width, top-2 (plus a 4x1024 router per layer):
    # what an update into vLLM's fused expert tensors costs against the dense layout.
    "94m-moe": dict(
        hidden_size=1024,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_experts=4,
        experts_per_token=2,
    ),
    # ~27M: where eight servers of the 94M one do not fit in one machine's memory (the
    # multi-host testbed's 8 hosts).
    "27m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def build_model(dtype: str, size: str = "294m") -> Path:
    """The model directory, its weights saved in ``dtype`` (what the servers serve)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from skyrl_grpc.tiny_model import TinyModelSpec, ensure_tiny_model

    built = ensure_tiny_model(spec=TinyModelSpec(**MODELS[size]))  # type: ignore[arg-type]
    if dtype == "float32":
        return built
    copy = built.with_name(built.name + f"-{dtype}")
    if not (copy / "model.safetensors").exists():
        shutil.copytree(built, copy, dirs_exist_ok=True)
        weights = load_file(str(built / "model.safetensors"))
        target = getattr(torch, dtype)
        save_file({n: t.to(target) for n, t in weights.items()}, str(copy / "model.safetensors"))
        config = json.loads((copy / "config.json").read_text())
        config["torch_dtype"] = dtype
        (copy / "config.json").write_text(json.dumps(config))
    return copy


class BenchModel(NamedTuple):
    """The benchmark model as built and read back: what the servers load, and what a trainer
    pushes."""

    path: Path
    tensors: list[tuple[str, Any]]  # sorted by name
    total_bytes: int
    parameters: int


def load_model(dtype: str, size: str = "294m") -> BenchModel:
    """``build_model(dtype, size)`` and its weights read back."""
    from safetensors.torch import load_file

    path = build_model(dtype, size)
    tensors = sorted(load_file(str(path / "model.safetensors")).items())
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    return BenchModel(path, tensors, total, sum(t.numel() for _, t in tensors))


# -- memory -------------------------------------------------------------------------------------


def own_memory(pid: int) -> int:
    """``tree_memory`` of the process alone (the engine servers are this one's children)."""
    return tree_memory(pid, alone=True)


# -- servers ------------------------------------------------------------------------------------


@contextmanager
def engine_servers(
    model: Path, count: int, tp: int, dtype: str, extra_args: Sequence[str] = ()
) -> Iterator[list[subprocess.Popen[str]]]:
    from servers.common.process import read_announcement
    from servers.common.reaper import EXIT_WITH_SUPERVISOR

    # The servers die with this process however it dies (their standard input: a pipe only it
    # holds; ``servers.common.reaper.exit_with_supervisor``): a bench killed mid-run must not
    # leave GBs of engines behind.
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(ROOT),
        EXIT_WITH_SUPERVISOR: "1",
    }
    args = ["--model", str(model), "--dtype", dtype, "--kv-cache-gib", "1", "--port", "0"]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--cpu-threads", "1"]
    args += extra_args
    processes = []
    try:
        for _ in range(count):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "servers.engine", *args],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        for process in processes:
            assert process.stdout is not None
            for line in process.stdout:
                event = read_announcement(line)
                if event is not None and event["event"] == "listening":
                    process.address = event["address"]  # type: ignore[attr-defined]
                if event is not None and event["event"] in ("ready", "failed"):
                    assert event["event"] == "ready", event
                    break
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def perturbed(tensors: list[tuple[str, Any]], seed: int) -> list[tuple[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        (n, t + 1e-3 * torch.randn(t.shape, generator=generator, dtype=t.dtype)) for n, t in tensors
    ]


class AdamMaster:
    """fp32 master weights and Adam's moments, stepped on random gradients."""

    def __init__(self, tensors: list[tuple[str, Any]], lr: float, seed: int) -> None:
        import torch

        self.lr = lr
        self.step_count = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.master = {n: t.float().clone() for n, t in tensors}
        self.m = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.v = {n: torch.zeros_like(t) for n, t in self.master.items()}

    def step(self) -> None:
        import torch

        self.step_count += 1
        t = self.step_count
        for name, weight in self.master.items():
            grad = torch.randn(weight.shape, generator=self.generator)
            self.m[name].mul_(0.9).add_(grad, alpha=0.1)
            self.v[name].mul_(0.999).addcmul_(grad, grad, value=0.001)
            m_hat = self.m[name] / (1 - 0.9**t)
            v_hat = self.v[name] / (1 - 0.999**t)
            weight.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))

    def serving(self, dtype: Any) -> list[tuple[str, Any]]:
        return [(n, t.to(dtype)) for n, t in self.master.items()]
