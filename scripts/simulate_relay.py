"""How long an in-band weight update takes to reach every server, and what the trainer sends,
at N = 1 ... 1024 servers: streamed by the trainer to each server (direct), relayed down a chain,
or down a tree of fan-out 2 or 4 (issue: servers relay the stream to each other, item 6).

The model, per frame of ``FRAME_BYTES`` (a chunk: what a server reads whole before forwarding
it): a server forwards each frame as it arrives, so the hops pipeline. A server sending ``k``
copies shares its link (``bandwidth / k``); each stream is moved by a thread of its own at
what one core does (sending or receiving over TCP, measured here on loopback). The stream's
pace is the slowest of those along the tree, and each level adds one frame's
store-and-forward time and the network's hop latency. Direct: the trainer's link carries N
copies. The servers' own staging and commit come after the last frame and cost the same in
every topology (excluded from the fleet figures; included, as measured, in the check below).

The check: on this machine the servers and the trainer share its cores, so the model there is
CPU (``check``), from the N = 1 measurements of ``bench_weight_fleet`` (its ``--json``): the
predictions for N = 2 and 4 are printed beside what it measured, with the error.

Run: .venv/bin/python -m scripts.simulate_relay [--measured /tmp/weight_fleet.json]
     [--plot docs/images/relay_simulation.png] [--output docs/weights.md]
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from scripts.bench_common import ROOT, add_output_argument, write_report

FRAME_BYTES = 4 << 20
# One hop's network latency in a datacenter (switch, NIC, kernel), seconds.
HOP_SECONDS = 50e-6
MODELS = {"7B": 7e9 * 2, "70B": 70e9 * 2}  # bfloat16 bytes
LINKS_GBIT = (25, 100, 400)
FLEETS = [2**i for i in range(11)]  # 1 ... 1024
TOPOLOGIES = {"direct": 0, "chain": 1, "tree 2": 2, "tree 4": 4}
# An RL step's patch: ~1% of elements changed, each an index and a value (docs/weights.md).
DELTA_FRACTION = 0.03


def loopback_cost(total: int = 1 << 30) -> float:
    """CPU seconds per byte to send frames over loopback TCP and receive them (both ends, this
    process): what one relay hop costs a server per byte it forwards."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    frame = bytes(FRAME_BYTES)

    def receive() -> None:
        connection, _ = listener.accept()
        buffer = bytearray(FRAME_BYTES)
        view, left = memoryview(buffer), total
        while left:
            got = connection.recv_into(view, min(len(view), left))
            if not got:
                break
            left -= got
        connection.close()

    receiver = threading.Thread(target=receive)
    receiver.start()
    sender = socket.create_connection(("127.0.0.1", port))
    before = psutil.Process().cpu_times()
    for _ in range(total // FRAME_BYTES):
        sender.sendall(frame)
    sender.close()
    receiver.join()
    after = psutil.Process().cpu_times()
    listener.close()
    return (after.user + after.system - before.user - before.system) / total


def depth(servers: int, fanout: int) -> int:
    """Levels of servers below the first one: a chain's N - 1, a tree's ~log_k N."""
    if servers <= 1:
        return 0
    if fanout == 1:
        return servers - 1
    levels, reached, width = 0, 1, 1
    while reached < servers:
        width *= fanout
        reached += width
        levels += 1
    return levels


def transfer_seconds(update: float, servers: int, fanout: int, link: float, rate: float) -> float:
    """Seconds until the last server has the last frame. ``link``: each host's link, bytes/s
    each way; ``rate``: what one stream's receiving (or sending) thread moves, bytes/s of CPU
    (a stream per thread: a server sending k copies sends them in parallel)."""
    if fanout == 0:  # direct: the trainer's link carries one copy per server
        return update / min(link / servers, rate) + HOP_SECONDS
    copies = min(fanout, max(servers - 1, 1))  # the most copies one server sends
    pace = min(link / copies, rate)
    frame = FRAME_BYTES / pace + FRAME_BYTES / rate + HOP_SECONDS  # sent on once received
    return update / pace + depth(servers, fanout) * frame + HOP_SECONDS


def fleet_table(rate: float) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "| model | update | link | N | direct s | chain s | tree 2 s | tree 4 s | fastest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    curves: dict[str, Any] = {}
    for model, size in MODELS.items():
        for kind, update in (("full", size), ("delta", size * DELTA_FRACTION)):
            for gbit in LINKS_GBIT:
                link = gbit * 1e9 / 8
                rows = {
                    name: [transfer_seconds(update, n, k, link, rate) for n in FLEETS]
                    for name, k in TOPOLOGIES.items()
                }
                curves[f"{model} {kind} {gbit}"] = rows
                for index, count in enumerate(FLEETS):
                    if count not in (1, 16, 1024):
                        continue
                    times = {name: rows[name][index] for name in TOPOLOGIES}
                    best = min(times, key=lambda name: times[name])
                    lines.append(
                        f"| {model} | {kind} | {gbit} Gbit/s | {count} | "
                        + " | ".join(f"{times[name]:.2f}" for name in TOPOLOGIES)
                        + f" | {best} |"
                    )
    return lines, curves


def check(measured: dict[str, Any], send_cost: float, cores: int) -> list[str]:
    """This machine's model against ``bench_weight_fleet``'s measurements: the trainer and N
    servers share ``cores``. At N = 1 an update keeps ``busy`` of them busy (its CPU seconds
    over its wall); at N, the work is the trainer's (plus one send per extra server, direct),
    N servers' own as at N = 1, and a send per relay hop; every engine not working spins at
    the measured idle rate, taking that much from the rest."""
    lines = [
        "| model | update | N | measured s | predicted s | error |",
        "|---|---|---|---|---|---|",
    ]
    for size, results in measured.items():
        fleets = {int(n): rows for n, rows in results["fleets"].items()}
        if 1 not in fleets:
            continue
        spin = fleets[1].get("idle", {}).get("server_cpu_per_second", 0.0)
        for row in ("relay full", "direct full", "relay delta", "direct delta"):
            one = fleets[1].get(row)
            if one is None:
                continue
            busy = (one["trainer_cpu"] + one["server_cpu"]) / one["wall"]
            sends = one["update_bytes"] * send_cost
            for count, rows in sorted(fleets.items()):
                if count == 1 or row not in rows:
                    continue
                work = one["trainer_cpu"] + count * one["server_cpu"] + (count - 1) * sends
                predicted = work / (busy - (count - 1) * spin)
                actual = rows[row]["wall"]
                lines.append(
                    f"| {size} | {row} | {count} | {actual:.2f} | {predicted:.2f} "
                    f"| {100 * (predicted - actual) / actual:+.0f}% |"
                )
    return lines


def plot(curves: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    for row, model in enumerate(MODELS):
        for column, gbit in enumerate(LINKS_GBIT):
            axis = axes[row][column]
            for name in TOPOLOGIES:
                axis.plot(FLEETS, curves[f"{model} full {gbit}"][name], label=name, marker=".")
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_title(f"{model} bf16 full update, {gbit} Gbit/s")
            axis.set_xlabel("servers")
            axis.set_ylabel("seconds until every server has it")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default="/tmp/weight_fleet.json")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "images" / "relay_simulation.png"))
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    started = time.perf_counter()
    per_byte = loopback_cost()
    send_cost = per_byte / 2  # a hop's send (its receive is the next server's own work)
    rate = 1 / send_cost  # one thread's stream, sending or receiving
    table, curves = fleet_table(rate)
    plot(curves, Path(args.plot))
    cores = psutil.cpu_count() or 1
    lines = [
        f"Measured here: a frame sent and received over loopback TCP costs {per_byte * 1e9:.2f}"
        f" CPU s per GB, both ends (one thread moves a stream at {rate / 1e9:.1f} GB/s). Fleet "
        f"figures: {FRAME_BYTES >> 20} MiB frames, {HOP_SECONDS * 1e6:.0f} us per hop, "
        f"one server per host, a delta {DELTA_FRACTION:.0%} of the model's bytes.",
        "",
        *table,
    ]
    measured_path = Path(args.measured)
    if measured_path.exists():
        measured = json.loads(measured_path.read_text())
        lines += [
            "",
            f"The model against `bench_weight_fleet` on this machine ({cores} cores shared by the "
            "trainer and every server), predicted from N = 1:",
            "",
            *check(measured, send_cost, cores),
        ]
    write_report(args.output, lines, "relay-simulation")
    print(f"({time.perf_counter() - started:.0f} s; the plot: {args.plot})")


if __name__ == "__main__":
    main()
