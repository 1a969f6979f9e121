"""Every fault the nemesis knows, at random, while the whole workload runs (issue 82's mixed
run): on the testbed, a client, a trainer, a router and ``--servers`` server hosts; the client
streams greedy generations through the router over gRPC and streamed completions through its
OpenAI edge, each with sessions of their own; the trainer runs an RL loop pushing its weights
every step (``testbed.rl_job``: the demo's task, retrying what a fault fails); the nemesis
(``testbed.nemesis``) applies a random schedule of partitions, links down, pairs cut off, loss
and delay everywhere, flapping links and killed server hosts (started again, catching up from
their peers), each healed, for ``--minutes``.

Then ``testbed.history.check`` reads the whole history (every call, every update, every
server the router could not reach and when): tokens lost or repeated, calls past their
deadline, versions split by an update, sessions moved off a reachable server. It prints the
faults applied, the workload's figures, the checker's verdict and the reward's rise, and puts
them in docs/fleet.md. ``python -m scripts.bench_nemesis --minutes 15``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scripts.bench_common import add_output_argument, write_report
from skyrl_grpc.tiny_model import ensure_tiny_model
from testbed import Host, Testbed
from testbed.history import History, Update, check
from testbed.nemesis import Nemesis, Roles
from testbed.stack import job_result, run_job, start_job, start_router, start_server

RATE_MBIT = 200
ENGINE_FLAGS = ("--kv-cache-gib", "0.125")
HTTP_PORT = 8000
JOB_SLACK_SECONDS = 600.0


def last_attempts(history: History) -> list[Any]:
    return list({c.key: c for c in sorted(history.calls, key=lambda c: c.started)}.values())


def faults_around(violation: Any, history: History, nemesis: Nemesis) -> list[str]:
    """The faults that overlapped the call a violation names (by its key in the message)."""
    calls = [c for c in history.calls if f"call {c.key} " in violation.what]
    return [
        f"{f.name} ({f.started - c.started:+.1f} s to {f.healed - c.started:+.1f} s from the "
        f"call's start)"
        for c in calls
        for f in nemesis.faults
        if f.started <= c.ended and f.healed >= c.started
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cut-out",
        action="store_true",
        help="the RL loop cuts out a server it cannot reach (cut_out_unreachable) instead of "
        "retrying its step until the server answers",
    )
    add_output_argument(parser, "fleet.md")
    args = parser.parse_args()
    seconds = args.minutes * 60
    logs = Path(tempfile.mkdtemp(prefix="nemesis-logs-"))
    with Testbed() as bed:
        client, trainer = bed.add_host("client", RATE_MBIT), bed.add_host("trainer", RATE_MBIT)
        router_host = bed.add_host("router", RATE_MBIT)
        hosts = [bed.add_host(f"s{i}", RATE_MBIT) for i in range(args.servers)]
        started = [start_server(h, *ENGINE_FLAGS, log_dir=logs) for h in hosts]
        addresses = [server.until("ready")["address"] for server in started]
        router = start_router(router_host, addresses, "--http-port", str(HTTP_PORT), log_dir=logs)
        router.until("ready")
        by_address = dict(zip(addresses, hosts, strict=True))
        back_after: list[float] = []

        def restart(host: Host) -> None:
            """A killed server host's server again, reading its peers' weights first."""
            (address,) = [a for a, h in by_address.items() if h is host]
            peers = ",".join(a for a in addresses if a != address)
            began = time.monotonic()
            flags = (*ENGINE_FLAGS, "--catch-up-from", peers)
            start_server(host, *flags, log_dir=logs).until("ready")
            back_after.append(time.monotonic() - began)

        nemesis = Nemesis(bed, Roles(router_host, trainer, by_address, restart, client))
        planned = nemesis.schedule(seconds, args.seed)
        common = {"seconds": seconds, "deadline": 120.0}
        streams = start_job(
            client,
            "streams",
            {"address": router.address, "streams": 4, "tokens": 128, **common},
            logs,
        )
        edge = start_job(
            client,
            "edge",
            {"address": f"http://{router_host.address}:{HTTP_PORT}", "streams": 2,
             "tokens": 64, "prefix": "edge", **common},
            logs,
        )  # fmt: skip
        rl = start_job(
            trainer,
            "rl",
            {"router": router.address, "servers": addresses, "model": str(ensure_tiny_model()),
             "seconds": seconds, "retry_seconds": 180,
             "client": {"cut_out_unreachable": args.cut_out}},
            logs,
        )  # fmt: skip
        began = time.monotonic()
        nemesis.run(planned)
        nemesis.join(seconds + JOB_SLACK_SECONDS)
        timeout = seconds + JOB_SLACK_SECONDS
        results = {name: job_result(job, timeout) for name, job in
                   (("streams", streams), ("edge", edge), ("rl", rl))}  # fmt: skip
        ran = time.monotonic() - began
        # Every host back at the end, at the fleet's version.
        end = run_job(client, "info", {"servers": addresses}, 300)
    histories = {n: History.from_json(results[n]["history"]) for n in ("streams", "edge")}
    history = History(
        calls=[c for h in histories.values() for c in h.calls],
        updates=[Update(**u) for u in results["rl"]["updates"]],
        outages=nemesis.outages(),
    )
    violations = check(history)
    # Everything the run saw, for a closer look at what the checker named.
    record = {
        "history": history.to_json(),
        "faults": [vars(f) for f in nemesis.faults],
        "rl": results["rl"],
    }
    (logs / "nemesis-run.json").write_text(json.dumps(record))
    for violation in violations:
        print(f"{violation}; faults around it: {faults_around(violation, history, nemesis)}")
    kinds = Counter(f.kind for f in nemesis.faults)
    fault_seconds = {
        k: sum(f.healed - f.started for f in nemesis.faults if f.kind == k) for k in kinds
    }
    rewards = results["rl"]["rewards"]
    committed = [u for u in history.updates if u.committed]
    ends = {address: found.get("version") for address, found in end.items()}
    lines = [
        f"A mixed run (`python -m scripts.bench_nemesis --minutes {args.minutes:g} --seed "
        f"{args.seed}{' --cut-out' if args.cut_out else ''}`): {ran / 60:.1f} minutes, "
        f"{args.servers} server hosts, links "
        f"{RATE_MBIT} Mbit/s, the embedded model, this 2-core VM.",
        "",
        "| fault | times | seconds in all |",
        "| --- | --- | --- |",
        *(f"| {k} | {kinds[k]} | {fault_seconds[k]:.0f} |" for k in sorted(kinds)),
        "",
        "| workload | requests | retried | answered OK |",
        "| --- | --- | --- | --- |",
    ]
    for name, h in histories.items():
        last = last_attempts(h)
        ok = sum(c.status == "OK" for c in last)
        lines.append(f"| {name} | {len(last)} | {len(h.calls) - len(last)} | {ok} |")
    lines += [
        "",
        f"- The history checker: **{len(violations)} violations**"
        + ("" if not violations else ": " + "; ".join(str(v) for v in violations[:10])),
        f"- RL loop: {len(rewards)} steps, {len(committed)} updates committed, "
        f"{len(history.updates) - len(committed)} failed and retried, "
        f"{sum(1 for u in committed if u.unreachable)} committed with a server cut out, "
        f"{len(results['rl']['given_up'])} given up; mean reward of the first 5 steps "
        f"{statistics.fmean(rewards[:5]):.3f}, of the last 5 {statistics.fmean(rewards[-5:]):.3f}",
        "- Killed server hosts serving again after their restart: "
        + (", ".join(f"{s:.0f} s" for s in back_after) or "none killed"),
        f"- At the end, every server's version: {ends}",
        f"- Everything the run saw: {logs / 'nemesis-run.json'}",
    ]
    write_report(args.output, lines, "nemesis")
    sys.exit(1 if violations or len(set(ends.values())) != 1 else 0)


if __name__ == "__main__":
    main()
