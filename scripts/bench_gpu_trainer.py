"""The trainer's CUDA paths at the 0.3B weight benchmark's shapes, on a GPU machine with no
vLLM (e.g. the project's lent H200):

- the delta of an lr-1e-6 bf16 step found on the GPU and on one CPU thread;
- device-to-host copies of the float32 weights, ordinary vs page-locked memory;
- a whole in-band stream made from CUDA tensors and sent over the push socket's framing to a
  process that reads frames as a server does (``scripts.frame_reader``): through ordinary
  memory, through the client's ``HostStaging``, and from host memory (the link alone), with
  the bytes checked equal.

Run: ``python -m scripts.bench_gpu_trainer`` (``--small``: six tensors, for a CPU). Prints the
figures as JSON and writes them to ``$OUT/gpu_trainer.json`` (default /tmp).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from skyrl_grpc.socket_frames import send_frame
from trainer_client.weights.delta_patches import weight_patches
from trainer_client.weights.weight_sending import HostStaging, PushStream, tensor_entries

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def benchmark_shapes() -> dict[str, list[int]]:
    """The parameters of the weight benchmark's model (``scripts.bench_weight_sync``: hidden
    2048, intermediate 4096, 8 layers, 16 heads / 4 KV heads of 128, the tiny tokenizer's
    2048 tokens): 294M parameters."""
    hidden, intermediate, kv, vocab = 2048, 4096, 512, 2048
    shapes = {
        "model.embed_tokens.weight": [vocab, hidden],
        "lm_head.weight": [vocab, hidden],
        "model.norm.weight": [hidden],
    }
    for layer in range(8):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": [hidden],
            prefix + "post_attention_layernorm.weight": [hidden],
            prefix + "self_attn.q_proj.weight": [hidden, hidden],
            prefix + "self_attn.k_proj.weight": [kv, hidden],
            prefix + "self_attn.v_proj.weight": [kv, hidden],
            prefix + "self_attn.o_proj.weight": [hidden, hidden],
            prefix + "mlp.gate_proj.weight": [intermediate, hidden],
            prefix + "mlp.up_proj.weight": [intermediate, hidden],
            prefix + "mlp.down_proj.weight": [hidden, intermediate],
        }
    return shapes


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[list[float], Any]:
    times, value = [], None
    for _ in range(repeat):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        value = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - started, 4))
    return times, value


def stream_once(port: int, make_stream: Callable[[], PushStream]) -> float:
    """Seconds to make a stream and send it whole to the frame reader at ``port``."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    started = time.perf_counter()
    for head, data in make_stream().frames():
        send_frame(sock, head, data)
    send_frame(sock)
    sock.recv(1)
    elapsed = time.perf_counter() - started
    sock.close()
    return round(elapsed, 4)


def deltas(master: dict[str, Any], generator: Any, results: dict[str, Any]) -> None:
    """The delta of an lr-1e-6 step in bf16 serving (Adam's first step moves each weight by
    ~lr), found on the GPU (the client's device path) and on one CPU thread (its host path)."""
    base = {n: t.to(torch.bfloat16) for n, t in master.items()}
    for weight in master.values():
        noise = torch.randn(weight.shape, generator=generator, device=DEVICE)
        weight.sub_(1e-6 * torch.sign(noise))
    new = [(n, t.to(torch.bfloat16)) for n, t in master.items()]
    full = sum(t.numel() * 2 for _, t in new)
    results["delta_bf16_gpu_seconds"], entries = timed(
        lambda: weight_patches(new, base, 1, False, False)
    )
    patch_bytes = sum(int(data.numel()) for _, data in entries)
    results["delta_bf16_bytes_fraction"] = round(patch_bytes / full, 4)
    results["delta_bf16_gpu_diff_plus_stream_to_host_seconds"], _ = timed(
        lambda: PushStream(weight_patches(new, base, 1, False, False))
    )
    if DEVICE == "cuda":
        staging = HostStaging()
        staging.reset(full)
        results["delta_bf16_gpu_diff_plus_pinned_stream_seconds"], _ = timed(
            lambda: PushStream(weight_patches(new, base, 1, False, False), staging=staging)
        )
    base_cpu = {n: t.cpu() for n, t in base.items()}
    new_cpu = [(n, t.cpu()) for n, t in new]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results["delta_bf16_cpu_1thread_seconds"], cpu_entries = timed(
        lambda: weight_patches(new_cpu, base_cpu, 1, False, False)
    )
    torch.set_num_threads(threads)
    assert sum(int(d.numel()) for _, d in cpu_entries) == patch_bytes, "the same patches"


def streams(master: dict[str, Any], results: dict[str, Any]) -> None:
    """Device-to-host copies and whole float32 streams: through ordinary memory, through
    ``HostStaging``, and from host memory."""
    weights = list(master.items())
    full = sum(t.numel() * 4 for _, t in weights)
    results["full_fp32_GB"] = round(full / 1e9, 3)
    results["d2h_pageable_seconds"], _ = timed(lambda: [t.cpu() for _, t in weights])
    reader = subprocess.Popen(
        [sys.executable, "-m", "scripts.frame_reader"], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout is not None
    port = int(reader.stdout.readline())
    host = [(n, t.cpu()) for n, t in weights]
    try:
        results["stream_fp32_from_host_seconds"] = [
            stream_once(port, lambda: PushStream(tensor_entries(host, False))) for _ in range(3)
        ]
        results["stream_fp32_from_cuda_seconds"] = [
            stream_once(port, lambda: PushStream(tensor_entries(weights, False))) for _ in range(3)
        ]
        if DEVICE == "cuda":
            staging = HostStaging()
            results["pinned_first_reset_seconds"], _ = timed(lambda: staging.reset(full), 1)

            def pinned() -> PushStream:
                staging.reset(full)
                return PushStream(tensor_entries(weights, False), staging=staging)

            results["stream_fp32_from_cuda_pinned_seconds"] = [
                stream_once(port, pinned) for _ in range(3)
            ]
            same = pinned()._crcs == PushStream(tensor_entries(host, False))._crcs
            results["pinned_bytes_equal_host_bytes"] = same
    finally:
        stop = socket.create_connection(("127.0.0.1", port))
        send_frame(stop)
        stop.recv(1)
        reader.wait(timeout=30)


def main() -> None:
    shapes = benchmark_shapes()
    if "--small" in sys.argv:
        shapes = dict(list(shapes.items())[:6])
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    master = {
        name: torch.randn(shape, generator=generator, device=DEVICE) * 0.02
        for name, shape in sorted(shapes.items())
    }
    results: dict[str, Any] = {"device": DEVICE, "cpus": os.cpu_count()}
    if DEVICE == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    results["parameters_M"] = round(sum(t.numel() for t in master.values()) / 1e6, 1)
    deltas(master, generator, results)
    streams(master, results)
    print(json.dumps(results, indent=1))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_trainer.json"), "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
