"""How long an in-band weight update takes to reach every server, and what the trainer sends,
at N = 1 ... 1024 server hosts, each host with a link of its own (issue: off one host):
streamed by the trainer to each server (direct), down one relay tree of fan-out 2 (what the
servers did before), down a chain, down ``k`` relay trees each carrying 1/k of the update
with every host forwarding in one of them (``trainer_client.weights.relay_plan``), and as the
client's default (``auto``: the whole weights down a chain up to 32 hosts on links a stream
fills, patches and the rest down 2 trees).

The model, per host link of ``R`` bytes/s each way (the trainer's ``R_t``): a link carries
what crosses it at the rate TCP leaves of it (``efficiency``: IP, TCP and Ethernet headers);
a server sending a share to ``f`` children sends each at 1/f of its uplink; a host receiving
``k`` shares at once gives each 1/k of its downlink; one relay stream moves at most what one
core moves (``core``, measured here over loopback TCP). A stream's pace is the slowest of
those on its path, and each hop adds the time of one chunk at that pace (a server forwards a
chunk once it has it whole). Direct: the trainer's uplink carries N copies. After the last
byte, every server commits (vLLM reloads the layers the update touched): ``commit``.

Calibrated on the testbed (``scripts/bench_multihost --json``): ``efficiency`` is the TCP
goodput over tc's rate measured on it (0.957 at MTU 1500), ``commit`` and ``start`` the N = 1
figures; where the testbed's hosts share this machine's two cores (the servers' commits run
N at a time on them), the check takes each row's commit as the testbed measured it, a term
no fleet of real hosts has. Its predictions are printed beside every measured row, with the error.

Run: .venv/bin/python -m scripts.simulate_relay [--measured /tmp/multihost.json]
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
from trainer_client.weights.relay_plan import CHAIN_MAX_HOSTS, FAST_STREAM_BYTES_PER_SECOND

# TCP's goodput over the link's rate at MTU 1500 (1448 payload bytes per 1514 on the wire),
# as measured on the testbed: 191.4 Mbit/s through a 200 Mbit/s tbf.
EFFICIENCY = 0.957
MAX_CHUNK = 4 << 20
MIN_CHUNK = 256 << 10
CHUNKS_PER_SHARE = 512  # weight_delivery.RELAY_CHUNKS_PER_SHARE
# One hop's network latency in a datacenter (switch, NIC, kernel), seconds.
HOP_SECONDS = 50e-6
# The servers' commit after the last byte, a 7B bf16 model on a GPU host (vLLM's reload).
FLEET_COMMIT_SECONDS = 1.0
MODELS = {"7B": 7e9 * 2, "70B": 70e9 * 2}  # bfloat16 bytes
LINKS_GBIT = (25, 100, 400)
FLEETS = [2**i for i in range(11)]  # 1 ... 1024
TOPOLOGIES = {"direct": 0, "one tree of 2": -2, "chain": 1, "2 trees": 2}
AUTO = "auto (default)"
# An RL step's patch: ~1% of elements changed, each an index and a value (docs/weights.md).
DELTA_FRACTION = 0.03


def loopback_rate(total: int = 1 << 30) -> float:
    """Bytes per CPU second one relay stream moves (a frame sent and received over loopback
    TCP, both ends in this process: a hop's send is the one server's, its receive the next's)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    frame = bytes(MAX_CHUNK)

    def receive() -> None:
        connection, _ = listener.accept()
        view, left = memoryview(bytearray(MAX_CHUNK)), total
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
    for _ in range(total // MAX_CHUNK):
        sender.sendall(frame)
    sender.close()
    receiver.join()
    after = psutil.Process().cpu_times()
    listener.close()
    return float(2 * total / (after.user + after.system - before.user - before.system))


def depth(hosts: int, fanout: int) -> int:
    """Links from the trainer to the farthest host: a chain's N, a k-ary tree's ~log_k N."""
    if fanout == 1:
        return hosts
    levels, reached, width = 1, 1, 1
    while reached < hosts:
        width *= fanout
        reached += width
        levels += 1
    return levels


def transfer_seconds(
    update: float, hosts: int, topology: int, link: float, trainer: float, core: float
) -> float:
    """Seconds until the last host has the last byte. ``link``, ``trainer``: the servers' and
    the trainer's links, bytes/s each way (TCP's efficiency applied); ``core``: one stream's
    most; ``topology``: 0 direct, 1 a chain, k > 1 k trees, -k one tree of fan-out k."""
    if topology == 0:
        pace = min(trainer / hosts, link, core)
        return update / pace + HOP_SECONDS
    if topology < 0:  # one tree: an interior host sends the whole update k times
        fanout = -topology
        copies = min(fanout, max(hosts - 1, 1))
        pace = min(trainer, link / copies, core)
        chunk: float = MAX_CHUNK
        return update / pace + depth(hosts, fanout) * (chunk / pace + HOP_SECONDS)
    trees = min(topology, hosts)
    share = update / trees
    # Each share takes 1/trees of the trainer's uplink and of each host's downlink; a host
    # sends its one share to ``trees`` children over its uplink.
    pace = min(trainer / trees, link / trees, core)
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, share / CHUNKS_PER_SHARE))
    return share / pace + depth(hosts, max(topology, 1)) * (chunk / pace + HOP_SECONDS)


def auto_topology(kind: str, hosts: int, link: float) -> int:
    """What the client's ``auto`` relays with (``relay_plan.fanout_for``, its bounds): 1 a
    chain, 2 trees."""
    chain = kind == "full" and hosts <= CHAIN_MAX_HOSTS and link < FAST_STREAM_BYTES_PER_SECOND
    return 1 if chain else 2


def fleet_table(core: float) -> tuple[list[str], dict[str, Any]]:
    names = [*TOPOLOGIES, AUTO]
    lines = [
        "| model | update | link | N | floor s | "
        + " | ".join(f"{name} s" for name in names)
        + " | auto x floor |",
        "|---|---|---|---|---|" + "---|" * len(names) + "---|",
    ]
    curves: dict[str, Any] = {}
    for model, size in MODELS.items():
        for kind, update in (("full", size), ("delta", size * DELTA_FRACTION)):
            for gbit in LINKS_GBIT:
                link = gbit * 1e9 / 8 * EFFICIENCY
                rows = {
                    name: [
                        transfer_seconds(update, n, k, link, link, core) + FLEET_COMMIT_SECONDS
                        for n in FLEETS
                    ]
                    for name, k in TOPOLOGIES.items()
                }
                rows[AUTO] = [
                    rows["chain" if auto_topology(kind, n, link) == 1 else "2 trees"][i]
                    for i, n in enumerate(FLEETS)
                ]
                curves[f"{model} {kind} {gbit}"] = rows
                floor = update / (gbit * 1e9 / 8)
                for index, count in enumerate(FLEETS):
                    if count not in (1, 16, 1024):
                        continue
                    lines.append(
                        f"| {model} | {kind} | {gbit} Gbit/s | {count} | {floor:.2f} | "
                        + " | ".join(f"{rows[name][index]:.2f}" for name in names)
                        + f" | {rows[AUTO][index] / floor:.2f} |"
                    )
    return lines, curves


def check(rows: list[dict[str, Any]], core: float) -> list[str]:
    """The model against ``bench_multihost``'s rows: its start and fixed costs taken from N = 1,
    the commit from each row (the servers' commits share this machine's cores)."""
    lines = [
        "| hosts | links (trainer : servers) | update | mode | measured s | predicted s | error |",
        "|---|---|---|---|---|---|---|",
    ]
    alone = {
        (r["mode"], r["kind"], r["model"]): r
        for r in rows
        if r["hosts"] == 1 and r["trainer_ratio"] == 1
    }
    for row in rows:
        # One host relays to no one: a chain's and auto's fixed costs are the trees' there.
        relayed = "direct" if row["mode"] == "direct" else "relay"
        one = alone.get((row["mode"], row["kind"], row["model"])) or alone.get(
            (relayed, row["kind"], row["model"])
        )
        if one is None:
            continue
        link = row["rate_mbit"] * 1e6 / 8 * EFFICIENCY
        trainer = link * row["trainer_ratio"]
        topology = {"relay": 2, "chain": 1, "direct": 0}.get(row["mode"])
        if topology is None:  # auto
            topology = auto_topology(row["kind"], row["hosts"], link)
        fixed = _median(one["seconds"]) - transfer_seconds(
            one["update_bytes"], 1, topology, link, link, core
        )
        # This machine's cores: the servers' commits run side by side on them, a CPU cost no
        # fleet of real hosts shares; taken as each row measured it (the model is the links').
        contention = row["commit"] - one["commit"]
        moved = transfer_seconds(row["update_bytes"], row["hosts"], topology, link, trainer, core)
        predicted = moved + fixed + contention
        measured = _median(row["seconds"])
        ratio = row["trainer_ratio"]
        lines.append(
            f"| {row['hosts']} | {row['rate_mbit'] * ratio:g} : {row['rate_mbit']:g} Mbit/s | "
            f"{row['kind']} | {row['mode']} | {measured:.2f} | {predicted:.2f} | "
            f"{100 * (predicted - measured) / measured:+.0f}% |"
        )
    return lines


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


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
            axis.plot(
                FLEETS, curves[f"{model} full {gbit}"][AUTO], label=AUTO, color="black",
                linestyle="--",
            )  # fmt: skip
            floor = MODELS[model] / (gbit * 1e9 / 8)
            axis.axhline(floor, color="grey", linestyle=":", label="floor")
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_title(f"{model} bf16 full update, {gbit} Gbit/s per host")
            axis.set_xlabel("server hosts")
            axis.set_ylabel("seconds until every server serves it")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default="/tmp/multihost.json")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "images" / "relay_simulation.png"))
    add_output_argument(parser, "weights.md")
    args = parser.parse_args()
    started = time.perf_counter()
    core = loopback_rate()
    table, curves = fleet_table(core)
    plot(curves, Path(args.plot))
    cores = psutil.cpu_count() or 1
    lines = [
        f"One relay stream moves {core / 1e9:.1f} GB/s of a core here (loopback TCP, both "
        f"ends). Fleet figures: one server per host, TCP at {EFFICIENCY:.3f} of each link, "
        f"{HOP_SECONDS * 1e6:.0f} us per hop, a commit of {FLEET_COMMIT_SECONDS:g} s, a delta "
        f"{DELTA_FRACTION:.0%} of the model's bytes; floor: the update's bytes over one link. "
        f"At 1024 hosts the 2 trees are {depth(1024, 2)} links deep.",
        "",
        *table,
    ]
    measured_path = Path(args.measured)
    if measured_path.exists():
        rows = json.loads(measured_path.read_text())
        lines += [
            "",
            f"The model against the testbed (`bench_multihost`, hosts on this machine's {cores}"
            " cores; start from its N = 1 rows, each row's commit as measured: the commits"
            " share the cores):",
            "",
            *check(rows, core),
        ]
    write_report(args.output, lines, "relay-simulation")
    print(f"({time.perf_counter() - started:.0f} s; the plot: {args.plot})")


if __name__ == "__main__":
    main()
