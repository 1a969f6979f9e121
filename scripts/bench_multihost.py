"""Weight updates across hosts against the link's floor (issue: off one host).

A testbed (``testbed``): a trainer host and N server hosts, network namespaces on one bridge,
each host's link shaped by tc to ``--rate`` Mbit/s both ways (the trainer's to ``--rate`` times
each ``--trainer-ratios`` factor), one engine server per server host (``--cpu-threads 1``: the
hosts share this machine's cores) serving a model built by the project's builder in float32
(~94M parameters; ~27M at 8 hosts, with a smaller KV cache and no staging memory allocated
at start, where eight 94M servers do not fit in this machine's 24 GiB). The trainer host pushes as a trainer on a machine of its own (``testbed.jobs``),
each update timed from ``update_weights`` until every server committed:

- **full**: every parameter, after a warm-up update;
- **delta**: an RL step's patch (1% of each tensor's elements changed) against the last push;

relayed down two trees (``weight_relay_fanout`` 2, the default before ``auto``) and sent to every
server directly (``weight_relay_fanout=0``; ``--modes`` adds ``chain``, fan-out 1: one chain, and
``auto``, the client's default),
interleaved round by round (where the trainer's
link is slower than the servers', relayed only: direct is then N times the floor). The floor is the
update's bytes over the slowest link they must cross: the trainer's uplink, or a server's
downlink (every server receives them once). Printed per row: floor, measured (median and
range over rounds), x floor, and the trainer's bytes sent over one server's update. The
table goes to docs/weights.md; ``--json`` keeps the rows for ``scripts/simulate_relay.py``.

``--distance``: per-step streams across a link with a round trip of ``--rtts`` ms instead (a
client host and a server host, each delaying what it sends by half of it: ``testbed.delay``),
64 concurrent greedy streams of 128 tokens on the embedded model from the client host
(``scripts/remote_rollouts``): this server's ``GenerateStream`` per request, the trainer
client's ``stream`` per request (over one ``GenerateMultiplex`` call) and this server's
``GenerateBatch`` for the whole batch, against vLLM's HTTP server's streamed completions on the
same host and engine settings, the idle contender frozen, rounds interleaved; the table goes
to docs/performance.md.

Run (root, on a machine of this kind): .venv/bin/python -m scripts.bench_multihost
     [--hosts 1,2,4,8] [--rate 200] [--trainer-ratios 1] [--rounds 2] [--json PATH]
     [--output docs/weights.md]
     .venv/bin/python -m scripts.bench_multihost --distance [--rtts 0,40] [--rate 1000]
     [--output docs/performance.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import ProcessTree, add_output_argument, median_range, write_report
from scripts.bench_models import build_model
from testbed import Host, Testbed
from testbed.peers import vllm_http_command
from testbed.stack import ROOT, run_job, start_server
from trainer_client.config import RelayFanout

# The client's ``weight_relay_fanout`` of each mode: "relay" two trees (the default before
# "auto"), "chain" one, "auto" the client's default (a chain for the whole weights up to 32
# hosts, two trees for patches).
MODES: dict[str, RelayFanout] = {"relay": 2, "direct": 0, "chain": 1, "auto": "auto"}
# A job's updates: a warm-up (whole: the client has no base yet, and keeps one), a delta
# against it, a full update (every parameter).
STEPS = [{"edit": 1}, {"edit": 2}, {"edit": 3, "delta": False}]
FULL, DELTA = 2, 1
SERVER_FLAGS = ("--dtype", "float32", "--cpu-threads", "1")
# Where eight servers must share this machine's memory.
SMALL_FLAGS = ("--kv-cache-gib", "0.25", "--weight-staging", "first-update")
JOB_SECONDS = 3600


def model_for(hosts: int, model: str = "auto") -> str:
    if model != "auto":
        return model
    return "27m" if hosts > 4 else "94m"


def server_flags(hosts: int) -> tuple[str, ...]:
    return (*SERVER_FLAGS, *(SMALL_FLAGS if hosts > 4 else ("--kv-cache-gib", "0.5")))


def measure(
    hosts: int,
    rate: float,
    trainer_ratio: float,
    rounds: int,
    modes: list[str],
    logs: Path,
    model_size: str = "auto",
    extra_flags: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Each of ``modes``' full and delta updates at ``hosts`` server hosts (every server
    started with ``extra_flags`` too)."""
    size = model_for(hosts, model_size)
    model = str(build_model("float32", size))
    trainer_rate = rate * trainer_ratio
    measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with Testbed() as bed:
        trainer = bed.add_host("trainer", trainer_rate)
        servers = [bed.add_host(f"s{i}", rate) for i in range(hosts)]
        flags = (*server_flags(hosts), *extra_flags)
        started = [start_server(h, "--model", model, *flags, log_dir=logs) for h in servers]
        addresses = [s.until("ready", timeout=1800)["address"] for s in started]
        for round_ in range(rounds):
            for mode in modes:
                fanout = MODES[mode]
                arguments = {
                    "servers": addresses,
                    "model": model,
                    "steps": STEPS,
                    "checksums": False,
                    "client": {"weight_relay_fanout": fanout},
                }
                result = run_job(trainer, "update", arguments, timeout=JOB_SECONDS)
                failed = [s["error"] for s in result["steps"] if "error" in s]
                if failed:  # the job stops at a failed update: the ones after it never ran
                    raise RuntimeError(f"{mode} at {hosts} hosts: {failed[0]}")
                for kind, index in (("full", FULL), ("delta", DELTA)):
                    step = result["steps"][index]
                    measured.setdefault((mode, kind), []).append(step)
                print(f"  {hosts} hosts, round {round_ + 1}, {mode} done", file=sys.stderr)
    rows = []
    for (mode, kind), steps in measured.items():
        update_bytes = max(max(s["bytes_received"].values()) for s in steps)
        floor = update_bytes / (min(rate, trainer_rate) * 1e6 / 8)
        seconds = [s["seconds"] for s in steps]
        rows.append(
            {
                "hosts": hosts,
                "model": size,
                "rate_mbit": rate,
                "trainer_ratio": trainer_ratio,
                "mode": mode,
                "kind": kind,
                "update_bytes": update_bytes,
                "floor": floor,
                "seconds": seconds,
                "x_floor": statistics.median(seconds) / floor,
                # The servers' commit: vLLM reloading the layers the update touched, after the
                # last byte (each server's, its slowest; the hosts share this machine's cores).
                "commit": statistics.median(max(s["commit_seconds"].values()) for s in steps),
                "sent_ratio": max(s["bytes_sent"] for s in steps) / update_bytes,
                # Where the trainer waited (``WeightUpdateResult.phases``), medians.
                "phases": {
                    phase: statistics.median(s["phases"].get(phase, 0.0) for s in steps)
                    for phase in PHASES
                },
            }
        )
    return rows


CONTENDERS = ("grpc-streams", "client-streams", "grpc-batch", "vllm-http")
VLLM_HTTP_PORT = 8000
STREAMS, TOKENS = 64, 128


def remote_rollouts(host: Host, arguments: dict[str, Any]) -> list[float]:
    done = host.run(
        [sys.executable, "-m", "scripts.remote_rollouts", json.dumps(arguments)],
        timeout=JOB_SECONDS,
        env={"PYTHONPATH": str(ROOT)},
    )
    for line in done.stdout.splitlines():
        if line.startswith("JOB-RESULT "):
            rates: list[float] = json.loads(line[len("JOB-RESULT ") :])["tok_s"]
            return rates
    raise RuntimeError(f"remote_rollouts on {host.name}: {done.stderr[-2000:]}")


def vllm_http_on(host: Host, logs: Path) -> Any:
    """vLLM's own OpenAI server on ``host`` with this project's engine settings."""
    command, env = vllm_http_command(host.address, VLLM_HTTP_PORT)
    logs.mkdir(parents=True, exist_ok=True)
    return host.popen(command, env, open(logs / "vllm-http.log", "a"), ROOT)


def distance(rtts: list[float], rate: float, rounds: int, logs: Path) -> list[str]:
    """Per-step streams and batches at each round trip, against vLLM's HTTP server."""
    measured: dict[tuple[float, str], list[float]] = {}
    with Testbed() as bed:
        client, server = bed.add_host("client", rate), bed.add_host("server", rate)
        engine = start_server(server, log_dir=logs)
        address = engine.until("ready")["address"]
        http = vllm_http_on(server, logs)
        health = f"http://{server.address}:{VLLM_HTTP_PORT}/health"
        wait = "import time,urllib.request as u\nfor _ in range(600):\n try:\n  u.urlopen(HEALTH,timeout=2); break\n except OSError: time.sleep(1)"
        client.run([sys.executable, "-c", wait.replace("HEALTH", repr(health))], JOB_SECONDS)
        trees = {"vllm-http": ProcessTree(http.pid)}
        ours = ("grpc-streams", "client-streams", "grpc-batch")
        trees.update({name: ProcessTree(engine.popen.pid) for name in ours})
        addresses = {
            **{name: address for name in ours},
            "vllm-http": f"{server.address}:{VLLM_HTTP_PORT}",
        }
        try:
            for rtt in rtts:
                for host in (client, server):
                    bed.delay(host, rtt / 2)
                for _ in range(rounds):
                    for name in CONTENDERS:
                        for other in trees.values():
                            other.freeze()
                        trees[name].thaw()
                        job = {"contender": name, "address": addresses[name]}
                        job.update(streams=STREAMS, tokens=TOKENS, rounds=1)
                        measured.setdefault((rtt, name), []).extend(remote_rollouts(client, job))
        finally:
            for tree in trees.values():
                tree.thaw()
    lines = [
        f"Per-step streams across a link (`python -m scripts.bench_multihost --distance`): a "
        f"client host and a server host on the testbed, links of {rate:g} Mbit/s, each host "
        f"delaying what it sends by half the round trip; {STREAMS} concurrent greedy streams "
        f"of {TOKENS} tokens on the embedded model, closed loop, {rounds} rounds interleaved, "
        "the idle contender frozen:",
        "",
        "| round trip | contender | tokens/s | x vLLM's HTTP server | x itself at the first round trip |",
        "|---|---|---|---|---|",
    ]
    for rtt in rtts:
        for name in CONTENDERS:
            rates = measured[(rtt, name)]
            against = statistics.median(rates) / statistics.median(measured[(rtt, "vllm-http")])
            kept = statistics.median(rates) / statistics.median(measured[(rtts[0], name)])
            lines.append(
                f"| {rtt:g} ms | {name} | {median_range(rates, 0)} | {against:.2f} | {kept:.2f} |"
            )
    return lines


PHASES = ("start", "transfer", "commit", "record")


def links(row: dict[str, Any]) -> str:
    """A row's links, the trainer's and the servers'."""
    return f"{row['rate_mbit'] * row['trainer_ratio']:g} : {row['rate_mbit']:g} Mbit/s"


def phase_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where the trainer waited in each row's updates (``UpdatePhases``: the transfer ends
    once every server staged what it received), medians in seconds."""
    lines = [
        "| hosts | update | mode | links (trainer : servers) | floor | "
        + " | ".join(PHASES)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(PHASES),
    ]
    for row in rows:
        if "phases" not in row:  # a row kept from a run before the phases were recorded
            continue
        cells = " | ".join(f"{row['phases'][phase]:.3f}" for phase in PHASES)
        lines.append(
            f"| {row['hosts']} | {row['kind']} | {row['mode']} | {links(row)} | {row['floor']:.2f} "
            f"| {cells} |"
        )
    return lines


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| hosts | model | links (trainer : servers) | update | mode | bytes | floor | measured"
        " | x floor | of it the commit | trainer sent |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        seconds = row["seconds"]
        spread = f"{statistics.median(seconds):.2f} s ({min(seconds):.2f}-{max(seconds):.2f})"
        lines.append(
            f"| {row['hosts']} | {row['model']} | {links(row)} | {row['kind']} | {row['mode']} | "
            f"{row['update_bytes'] / 1e6:.1f} MB | {row['floor']:.2f} s | {spread} | "
            f"{row['x_floor']:.3f} | {row['commit']:.2f} s | {row['sent_ratio']:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,2,4,8")
    parser.add_argument("--rate", type=float, default=200.0, help="each link's Mbit/s")
    parser.add_argument(
        "--trainer-ratios",
        default="1",
        help="the trainer's link over a server's, e.g. 0.25,1,4 (ratios other than 1 at "
        "--ratio-hosts only; below 1, relayed only)",
    )
    parser.add_argument("--ratio-hosts", type=int, default=4)
    parser.add_argument("--distance", action="store_true", help="per-step streams instead")
    parser.add_argument("--rtts", default="0,40", help="round trips (ms) for --distance")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--modes",
        default="relay,direct",
        help=f"of {', '.join(MODES)} (where the trainer's link is slower, direct is left out)",
    )
    parser.add_argument("--json", default="", help="write the rows here too")
    parser.add_argument(
        "--add-to",
        default="",
        help="an earlier run's --json: its rows are kept in the table, this run's added (a "
        "point measured again replaces them)",
    )
    parser.add_argument(
        "--model",
        default="auto",
        help="the builder's size for every point (auto: 94m up to 4 hosts, 27m above)",
    )
    parser.add_argument("--logs", default="/tmp/bench-multihost-logs")
    parser.add_argument(
        "--server-flags",
        default="",
        help="more flags for every engine server, e.g. --weight-commit-prepare",
    )
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    if args.distance:
        rtts = [float(r) for r in args.rtts.split(",")]
        lines = distance(rtts, args.rate, args.rounds, Path(args.logs))
        output = args.output.replace("weights.md", "performance.md")
        write_report(output, lines, "distance-streams")
        return
    asked = args.modes.split(",")
    if unknown := set(asked) - set(MODES):
        parser.error(f"--modes: {', '.join(sorted(unknown))}: use {', '.join(MODES)}")
    hosts = [int(h) for h in args.hosts.split(",")]
    ratios = [float(r) for r in args.trainer_ratios.split(",")]
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    failed = []
    for count in hosts:
        for ratio in ratios:
            if ratio != 1 and count != args.ratio_hosts:
                continue
            modes = [m for m in asked if ratio >= 1 or m != "direct"]
            try:
                rows += measure(
                    count,
                    args.rate,
                    ratio,
                    args.rounds,
                    modes,
                    Path(args.logs),
                    args.model,
                    tuple(args.server_flags.split()),
                )
            except Exception as error:  # the other points still run, and this one is said
                failed.append(f"- {count} hosts, trainer link x{ratio:g}: {error}")
            if args.json:  # kept as it goes: a later point's failure loses nothing
                Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.add_to:
        measured_now = {(r["hosts"], r["trainer_ratio"]) for r in rows}
        earlier = json.loads(Path(args.add_to).read_text())
        kept = [r for r in earlier if (r["hosts"], r["trainer_ratio"]) not in measured_now]
        rows = sorted(kept + rows, key=lambda r: (r["hosts"], r["trainer_ratio"]))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    rounds = sorted({len(r["seconds"]) for r in rows})
    lines = [
        f"Measured on the testbed: a trainer host and N server hosts, one engine server each "
        f"(`python -m scripts.bench_multihost`, {'/'.join(map(str, rounds))} rounds, modes "
        f"interleaved, {(time.monotonic() - began) / 60:.0f} min on this 2-core VM); floor = "
        "the update's "
        "bytes over the slowest link they cross, MTU 1500 (TCP/IP and Ethernet headers are "
        "4.5% of a full frame: the best measurable is ~1.05x):",
        "",
        *table(rows),
        "",
        "Where the trainer waited (`WeightUpdateResult.phases`, medians in seconds; the "
        "transfer ends once every server staged what it received):",
        "",
        *phase_table(rows),
        *(["", "Not measured:", *failed] if failed else []),
    ]
    write_report(args.output, lines, "multihost-updates")


if __name__ == "__main__":
    main()
