"""The stack against what a user would pick instead, side by side in one run (issue: benchmarks).

Streaming token-id generation, same model (the embedded tiny model, where the serving layer is
the bottleneck), same engine settings, same prompts, same concurrency, contenders alternating:

- ``stack``      client -> router -> engine server (gRPC GenerateStream, x-session-id per stream)
- ``direct``     client -> engine server (the router's cost is the difference)
- ``vllm-http``  vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server), streaming
                 /v1/completions with token-id prompts to an aiohttp client
- ``in-process`` AsyncLLM.generate called directly in its own process (the limit)
- ``trainer-client`` (whole samples only) InferenceClient.generate through the router, as a
                 trainer calls it

at 1, 16, 64 and 256 concurrent streams: output tokens/s, p50/p99 time to first token, p50
inter-token latency; each once with a message per engine step (stream interval 1) and once with
16-token messages (the same interval for every contender: vLLM's --stream-interval, AsyncLLM's
SamplingParams.stream_interval, our GenerateStreamRequest.stream_interval).

Then control-plane fan-out (pause -> resume round trip across 1, 2 and 4 servers with generation
in flight) and the weight-transfer figures (scripts/bench_weights.py, run as a subprocess).

Run: .venv/bin/python scripts/bench_stack.py [--quick] [--output docs/bench-stack.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from servers.engine.options import EngineOptions  # noqa: E402
from servers.fleet.local import LocalFleet  # noqa: E402
from skyrl_grpc.metadata import SESSION_ID  # noqa: E402
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc  # noqa: E402
from skyrl_grpc.v1 import generation_pb2 as gen  # noqa: E402
from tests.helpers.vllm_http import SERVED_NAME  # noqa: E402
from tests.helpers.vllm_http import vllm_http_server as launch_vllm_http  # noqa: E402
from trainer_client import InferenceClient  # noqa: E402

PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Workload:
    concurrency: int
    requests_per_stream: int
    max_tokens: int
    # Tokens per streamed message after the first; 0: whole samples in one response instead
    # of a stream (unary Generate, a non-streaming completion, AsyncLLM FINAL_ONLY).
    stream_interval: int

    @property
    def streaming(self) -> bool:
        return self.stream_interval > 0


@dataclass
class Timing:
    """One request, in seconds from its start."""

    first_token: float
    end: float
    tokens: int


def prompt_for(stream: int, turn: int) -> list[int]:
    """The same prompts for every contender; distinct per request (ids 3..2002 are ordinary)."""
    return [1] + [3 + (stream * 31 + turn * 17 + k * 7) % 2000 for k in range(PROMPT_TOKENS - 1)]


def write_report(output: str, lines: list[str]) -> None:
    """Writes a benchmark's markdown report and prints it."""
    text = "\n".join(lines) + "\n"
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text)
    print(text)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(timings: list[Timing], wall: float) -> dict[str, float]:
    tokens = sum(t.tokens for t in timings)
    ttft = [t.first_token for t in timings]
    # Inter-token latency per request: the time between its first and last token over the
    # tokens in between (comparable whether tokens arrive one per message or coalesced).
    itl = [(t.end - t.first_token) / (t.tokens - 1) for t in timings if t.tokens > 1]
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": statistics.median(itl) if itl else 0.0,
        "tokens": float(tokens),
    }


async def run_closed_loop(
    one_request: Callable[[int, int], Awaitable[Timing]], workload: Workload
) -> dict[str, float]:
    """``concurrency`` streams, each sending its requests one after another."""
    timings: list[Timing] = []

    async def stream(index: int) -> None:
        for turn in range(workload.requests_per_stream):
            timings.append(await one_request(index, turn))

    started = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(workload.concurrency)))
    return summarize(timings, time.perf_counter() - started)


# -- contenders ---------------------------------------------------------------------------------


class GrpcContender:
    """GenerateStream to an address: the router (the stack) or one engine server (direct)."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address

    async def run(self, workload: Workload) -> dict[str, float]:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = data_plane_pb2_grpc.DataPlaneStub(channel)

            params = gen.SamplingParams(
                temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True
            )

            async def one(index: int, turn: int) -> Timing:
                metadata = ((SESSION_ID, f"session-{index}"),)
                started = time.perf_counter()
                if not workload.streaming:
                    response = await stub.Generate(
                        data_plane_pb2.GenerateRequest(
                            prompt_token_ids=prompt_for(index, turn), sampling_params=params
                        ),
                        metadata=metadata,
                    )
                    ended = time.perf_counter() - started
                    return Timing(ended, ended, len(response.samples[0].token_ids))
                request = data_plane_pb2.GenerateStreamRequest(
                    prompt_token_ids=prompt_for(index, turn),
                    sampling_params=params,
                    stream_interval=workload.stream_interval,
                )
                first = 0.0
                tokens = 0
                async for chunk in stub.GenerateStream(request, metadata=metadata):
                    if chunk.token_ids and not tokens:
                        first = time.perf_counter() - started
                    tokens += len(chunk.token_ids)
                return Timing(first, time.perf_counter() - started, tokens)

            return await run_closed_loop(one, workload)


class TrainerClientContender:
    """What an RL trainer calls: InferenceClient.generate through the router, whole samples
    (streamed underneath in the client's default 16-token messages, resubmitted on aborts)."""

    name = "trainer-client"

    def __init__(self, router: str) -> None:
        self.router = router

    async def run(self, workload: Workload) -> dict[str, float]:
        async with InferenceClient(self.router, direct=False) as client:
            sampling = {"temperature": 0.0, "max_tokens": workload.max_tokens, "ignore_eos": True}

            async def one(index: int, turn: int) -> Timing:
                started = time.perf_counter()
                result = await client.generate(
                    prompt_for(index, turn), sampling, session_id=f"session-{index}"
                )
                ended = time.perf_counter() - started
                return Timing(ended, ended, len(result.token_ids))

            return await run_closed_loop(one, workload)


class HttpContender:
    """vLLM's OpenAI server: streaming /v1/completions, prompts as token ids."""

    name = "vllm-http"

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url
        self.model = model

    async def run(self, workload: Workload) -> dict[str, float]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def one(index: int, turn: int) -> Timing:
                body = {
                    "model": self.model,
                    "prompt": prompt_for(index, turn),
                    "max_tokens": workload.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": workload.streaming,
                    "return_token_ids": True,
                }
                started = time.perf_counter()
                first = 0.0
                tokens = 0
                async with session.post(f"{self.base_url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    if not workload.streaming:
                        result = await response.json()
                        ended = time.perf_counter() - started
                        return Timing(ended, ended, len(result["choices"][0]["token_ids"]))
                    async for line in response.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        event = json.loads(line[6:])
                        new = len(event["choices"][0].get("token_ids") or ())
                        if new and not tokens:
                            first = time.perf_counter() - started
                        tokens += new
                return Timing(first, time.perf_counter() - started, tokens)

            return await run_closed_loop(one, workload)


class InProcessContender:
    """AsyncLLM called directly, in a child process of this script (``--in-process-worker``)."""

    name = "in-process"

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--in-process-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
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

    async def run(self, workload: Workload) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(asdict(workload)) + "\n")
        self.process.stdin.flush()
        result = await asyncio.to_thread(self._expect, "result")
        return result["summary"]  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def in_process_worker() -> None:
    """Child process: the engine exactly as the engine server builds it, driven directly."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from servers.engine.vllm_engine import VllmEngine

    engine = await VllmEngine.start(EngineOptions())
    counter = 0

    async def one(workload: Workload, index: int, turn: int) -> Timing:
        nonlocal counter
        counter += 1
        params = SamplingParams(
            temperature=0.0,
            max_tokens=workload.max_tokens,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA
            if workload.streaming
            else RequestOutputKind.FINAL_ONLY,
            stream_interval=max(workload.stream_interval, 1),
        )
        started = time.perf_counter()
        first = 0.0
        tokens = 0
        # Through the engine's own loop, as the server drives vLLM (vllm_engine.generate).
        async for new in engine.generate(
            f"bench-{counter}",
            prompt_for(index, turn),
            params,
            lambda output: (len(output.outputs[0].token_ids),),
        ):
            if new and not tokens:
                first = time.perf_counter() - started
            tokens += new
        return Timing(first, time.perf_counter() - started, tokens)

    print(json.dumps({"kind": "ready"}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        workload = Workload(**json.loads(line))
        summary = await run_closed_loop(functools.partial(one, workload), workload)
        print(json.dumps({"kind": "result", "summary": summary}), flush=True)
    await engine.shutdown()


@contextlib.contextmanager
def vllm_http_server(stream_interval: int) -> Iterator[HttpContender]:
    """vLLM's own server on the same model with the engine settings our server uses."""
    with launch_vllm_http(stream_interval) as base_url:
        yield HttpContender(base_url, SERVED_NAME)


# -- sections -----------------------------------------------------------------------------------


Contender = GrpcContender | TrainerClientContender | HttpContender | InProcessContender


async def compare(
    contenders: list[Contender], workload: Workload, rounds: int
) -> dict[str, dict[str, float]]:
    """Median of ``rounds`` runs per contender, rotating the order so drift hits every one."""
    runs: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    for round_index in range(rounds):
        shift = round_index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            runs[contender.name].append(await contender.run(workload))
    return {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }


def requests_per_stream(concurrency: int, quick: bool) -> int:
    """Enough requests that each point measures a few seconds of steady state."""
    if quick:
        return 1 if concurrency >= 64 else 2
    return {1: 8, 16: 6, 64: 4, 256: 2}.get(concurrency, 2)


async def throughput_section(args: argparse.Namespace) -> list[str]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    intervals = [int(i) for i in args.stream_intervals.split(",")]
    lines: list[str] = []
    ratios: list[str] = []
    in_process = InProcessContender()
    try:
        with LocalFleet(1) as stack, contextlib.ExitStack() as http_servers:
            stack_contenders: list[Contender] = [
                GrpcContender("stack", stack.addresses.router),
                GrpcContender("direct", stack.addresses.servers[0]),
            ]
            http: HttpContender | None = None
            http_interval = 0
            for interval in intervals:
                if http is None or max(interval, 1) != http_interval:
                    http_servers.close()  # one vLLM server at a time: --stream-interval is global
                    http_interval = max(interval, 1)
                    http = http_servers.enter_context(vllm_http_server(http_interval))
                contenders = [*stack_contenders, http, in_process]
                if interval == 0:
                    contenders.insert(2, TrainerClientContender(stack.addresses.router))
                warm = Workload(16, 1, 16, interval)
                for contender in contenders:  # first generations are slow everywhere
                    await contender.run(warm)
                if interval == 0:
                    title = (
                        "Whole samples (Generate / non-streaming completion / FINAL_ONLY; "
                        "TTFT here is the whole request's latency)"
                    )
                elif interval == 1:
                    title = "Streaming, stream interval 1 (a message per engine step)"
                else:
                    title = f"Streaming, stream interval {interval} (tokens per message)"
                lines += [
                    "",
                    f"### {title}",
                    "",
                    "| streams | contender | output tok/s | p50 TTFT (ms) | p99 TTFT (ms) "
                    "| p50 ITL (ms) | tok/s vs in-process |",
                    "| --- | --- | --- | --- | --- | --- | --- |",
                ]
                for concurrency in concurrencies:
                    workload = Workload(
                        concurrency,
                        requests_per_stream(concurrency, args.quick),
                        args.max_tokens,
                        interval,
                    )
                    results = await compare(contenders, workload, args.rounds)
                    limit = results["in-process"]["tokens_per_s"]
                    for name, s in results.items():
                        lines.append(
                            f"| {concurrency} | {name} | {s['tokens_per_s']:.0f} "
                            f"| {s['ttft_p50'] * 1e3:.1f} | {s['ttft_p99'] * 1e3:.1f} "
                            f"| {s['itl_p50'] * 1e3:.2f} | {s['tokens_per_s'] / limit:.2f}x |"
                        )
                    print("\n".join(lines[-len(results) :]), flush=True)
                    stack_s, http_s = results["stack"], results["vllm-http"]
                    direct_s = results["direct"]
                    ratios.append(
                        f"| {interval or 'whole'} | {concurrency} "
                        f"| {stack_s['tokens_per_s'] / limit:.2f}x "
                        f"| {stack_s['tokens_per_s'] / http_s['tokens_per_s']:.2f}x "
                        f"| {stack_s['ttft_p50'] * 1e3:.1f} vs {http_s['ttft_p50'] * 1e3:.1f} "
                        f"| {stack_s['tokens_per_s'] / direct_s['tokens_per_s']:.2f}x "
                        f"| {(stack_s['itl_p50'] - direct_s['itl_p50']) * 1e3:+.2f} |"
                    )
    finally:
        in_process.close()
    return [
        "## Generation",
        "",
        "Ratios (targets at 64 streams: stack >= 0.8x in-process; stack >= 1.5x vLLM HTTP "
        "with p50 TTFT no worse):",
        "",
        "| interval | streams | stack / in-process | stack / vLLM HTTP | p50 TTFT stack vs HTTP "
        "(ms) | stack / direct (router cost) | p50 ITL added by the router (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *ratios,
        *lines,
    ]


async def background_load(router: str, stop: asyncio.Event) -> int:
    """Generation kept in flight through the router until ``stop``; returns tokens received."""
    tokens = 0
    async with grpc.aio.insecure_channel(router) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)

        async def stream(index: int) -> None:
            nonlocal tokens
            turn = 0
            while not stop.is_set():
                turn += 1
                request = data_plane_pb2.GenerateStreamRequest(
                    prompt_token_ids=prompt_for(index, turn),
                    sampling_params=gen.SamplingParams(
                        temperature=0.0, max_tokens=128, ignore_eos=True
                    ),
                )
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for chunk in stub.GenerateStream(
                        request, metadata=((SESSION_ID, f"load-{index}"),)
                    ):
                        tokens += len(chunk.token_ids)

        await asyncio.gather(*(stream(i) for i in range(32)))
    return tokens


async def fan_out_section(args: argparse.Namespace) -> list[str]:
    sizes = [int(n) for n in args.fan_out_servers.split(",")]
    rows = [
        "## Control-plane fan-out",
        "",
        f"Pause -> resume round trip from the trainer client to every server at once, "
        f"{args.fan_out_repeats} times per row, with 32 streams generating through the router "
        f"over all {max(sizes)} servers (all on this 2-core machine).",
        "",
        "| servers | mode | p50 round trip (ms) | p99 round trip (ms) |",
        "| --- | --- | --- | --- |",
    ]
    with LocalFleet(max(sizes)) as stack:
        stop = asyncio.Event()
        load = asyncio.create_task(background_load(stack.addresses.router, stop))
        await asyncio.sleep(2)
        for size in sizes:
            client = InferenceClient(stack.addresses.router, stack.addresses.servers[:size])
            for mode in ("keep", "abort"):
                times = []
                for _ in range(args.fan_out_repeats):
                    started = time.perf_counter()
                    await client.pause(mode)
                    await client.resume()
                    times.append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)  # let generation run between pauses
                rows.append(
                    f"| {size} | {mode} | {statistics.median(times) * 1e3:.1f} "
                    f"| {percentile(times, 0.99) * 1e3:.1f} |"
                )
                print(rows[-1], flush=True)
            await client.close()
        stop.set()
        generated = await load
    rows += ["", f"Tokens generated by the background load meanwhile: {generated}."]
    return rows


def weights_section(args: argparse.Namespace) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "weights.md"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "bench_weights.py"),
                "--gib",
                str(args.weights_gib),
                "--output",
                str(output),
            ],
            check=True,
            cwd=ROOT,
        )
        text = output.read_text().splitlines()
    body = [line for line in text if not line.startswith("# ")]
    return ["## Weight transfer (scripts/bench_weights.py, run by this script)", *body]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--stream-intervals", default="1,16,0", help="0: whole samples")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fan-out-servers", default="1,2,4")
    parser.add_argument("--fan-out-repeats", type=int, default=20)
    parser.add_argument("--weights-gib", type=float, default=1.0, help="0: skip the weight section")
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--sections", default="throughput,fan-out,weights")
    parser.add_argument("--output", default=str(ROOT / "docs" / "bench-stack.md"))
    args = parser.parse_args()
    if args.in_process_worker:
        await in_process_worker()
        return

    sections = args.sections.split(",")
    command = "scripts/bench_stack.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Benchmarks",
        "",
        f"Command: `.venv/bin/python {command.strip()}` (one run; every contender on this "
        f"machine: {os.cpu_count()} cores, no GPU; the embedded tiny model; {args.max_tokens} "
        f"output tokens per request, {PROMPT_TOKENS}-token prompts; medians of {args.rounds} "
        "rounds with the contenders' order rotated). What the figures mean, the profiles behind "
        "them and what was changed because of them: docs/performance.md.",
    ]
    if "throughput" in sections:
        lines += ["", *await throughput_section(args)]
    if "fan-out" in sections:
        lines += ["", *await fan_out_section(args)]
    if "weights" in sections and args.weights_gib > 0:
        lines += ["", *weights_section(args)]
    write_report(args.output, lines)


if __name__ == "__main__":
    asyncio.run(main())
