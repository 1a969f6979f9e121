"""Weight updates across hosts against the link's floor (issue: off one host).

A testbed (``testbed``): a trainer host and N server hosts, network namespaces on one bridge,
each host's link shaped by tc to ``--rate`` Mbit/s both ways (the trainer's to ``--rate`` times
each ``--trainer-ratios`` factor), one engine server per server host (``--cpu-threads 1``: the
hosts share this machine's cores) serving a model built by the project's builder (~94M
parameters float32; ~53M at 8 hosts, where eight 94M servers do not fit in this machine's
memory). The trainer host pushes as a trainer on a machine of its own (``testbed.jobs``),
each update timed from ``update_weights`` until every server committed:

- **full**: every parameter, after a warm-up update;
- **delta**: an RL step's patch (1% of each tensor's elements changed) against the last push;

relayed (the client's default: ``weight_relay_fanout`` 2, two relay trees) and sent to every
server directly (``weight_relay_fanout=0``), interleaved round by round. The floor is the
update's bytes over the slowest link they must cross: the trainer's uplink, or a server's
downlink (every server receives them once). Printed per row: floor, measured (median and
range over rounds), x floor, and the trainer's bytes sent over one server's update. The
table goes to docs/weights.md; ``--json`` keeps the rows for ``scripts/simulate_relay.py``.

Run (root, on a machine of this kind): .venv/bin/python -m scripts.bench_multihost
     [--hosts 1,2,4,8] [--rate 200] [--trainer-ratios 1] [--rounds 2] [--json PATH]
     [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import add_output_argument, write_report
from scripts.bench_models import build_model
from testbed import Testbed
from testbed.stack import run_job, start_server

MODES = {"relay": 2, "direct": 0}
# Per update: the warm-up and full update, then a whole push that keeps a base, then a delta.
STEPS = [{"edit": 1}, {"edit": 2, "delta": False}, {"edit": 3}, {"edit": 4}]
FULL, DELTA = 1, 3
SERVER_FLAGS = ("--kv-cache-gib", "0.5", "--cpu-threads", "1")
JOB_SECONDS = 3600


def model_for(hosts: int) -> str:
    return "53m" if hosts > 4 else "94m"


def measure(
    hosts: int, rate: float, trainer_ratio: float, rounds: int, logs: Path
) -> list[dict[str, Any]]:
    """Each mode's full and delta updates at ``hosts`` server hosts."""
    size = model_for(hosts)
    model = str(build_model("float32", size))
    trainer_rate = rate * trainer_ratio
    measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with Testbed() as bed:
        trainer = bed.add_host("trainer", trainer_rate)
        servers = [bed.add_host(f"s{i}", rate) for i in range(hosts)]
        started = [start_server(h, "--model", model, *SERVER_FLAGS, log_dir=logs) for h in servers]
        addresses = [s.until("ready", timeout=1800)["address"] for s in started]
        for round_ in range(rounds):
            for mode, fanout in MODES.items():
                arguments = {
                    "servers": addresses,
                    "model": model,
                    "steps": STEPS,
                    "checksums": False,
                    "client": {"weight_relay_fanout": fanout},
                }
                result = run_job(trainer, "update", arguments, timeout=JOB_SECONDS)
                for kind, index in (("full", FULL), ("delta", DELTA)):
                    step = result["steps"][index]
                    if "error" in step:
                        raise RuntimeError(f"{mode} {kind} at {hosts} hosts: {step['error']}")
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
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| hosts | model | links (trainer : servers) | update | mode | bytes | floor | measured"
        " | x floor | of it the commit | trainer sent |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        seconds = row["seconds"]
        spread = f"{statistics.median(seconds):.2f} s ({min(seconds):.2f}-{max(seconds):.2f})"
        ratio = row["trainer_ratio"]
        links = f"{row['rate_mbit'] * ratio:g} : {row['rate_mbit']:g} Mbit/s"
        lines.append(
            f"| {row['hosts']} | {row['model']} | {links} | {row['kind']} | {row['mode']} | "
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
        help="the trainer's link over a server's, e.g. 0.25,1,4 (at the largest --hosts only "
        "for ratios other than 1)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="write the rows here too")
    parser.add_argument("--logs", default="/tmp/bench-multihost-logs")
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    hosts = [int(h) for h in args.hosts.split(",")]
    ratios = [float(r) for r in args.trainer_ratios.split(",")]
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    for count in hosts:
        for ratio in ratios:
            if ratio != 1 and count != max(hosts):
                continue
            rows += measure(count, args.rate, ratio, args.rounds, Path(args.logs))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    lines = [
        f"Measured on the testbed: a trainer host and N server hosts, one engine server each "
        f"(`python -m scripts.bench_multihost`, {args.rounds} rounds, modes interleaved, "
        f"{(time.monotonic() - began) / 60:.0f} min on this 2-core VM); floor = the update's "
        "bytes over the slowest link they cross, MTU 1500 (TCP/IP and Ethernet headers are "
        "4.5% of a full frame: the best measurable is ~1.05x):",
        "",
        *table(rows),
    ]
    write_report(args.output, lines, "multihost-updates")


if __name__ == "__main__":
    main()
