"""Session placement, side by side in one run (issue: sessions that place themselves).

1. Simulation (no engine, the default): 4 servers, 1,000 multi-turn sessions with heavy-tailed
   numbers of turns and turn lengths, arriving (Poisson) and finishing (FinishSession) over
   time; one server removed midway and added back later. The same workload (same seed) is
   replayed through each placement policy, the very classes the router runs
   (``skyrl_grpc.placement``), with servers reporting their sessions the way ServerStatus does.
   Printed per policy: max/mean live sessions per server (sampled every simulated second while
   the mean is at least 20 per server: time average, p99, worst) and the share of turns that
   landed on the server holding their session (where its KV cache is), over all turns and
   outside the membership change (from the removal to ``--settle`` seconds after the re-add).
2. ``--engines``: the same kind of workload at small scale through a router against two real
   engine servers (tiny model), one router per policy over the same two servers, run one after
   the other: output tokens/s and prefix-cache hits (``Usage.cached_prompt_tokens``).

Run: .venv/bin/python -m scripts.bench_placement [--engines] [--output docs/serving.md]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

from scripts.bench_common import add_output_argument, write_report
from skyrl_grpc.placement import POLICIES, PlacementPolicy, make_policy

# -- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    generate_s: float  # time the server spends generating (the turn's length)
    think_s: float  # time until the next turn (tool call, environment step)


@dataclass(frozen=True)
class Session:
    sid: str
    arrival_s: float
    turns: tuple[Turn, ...]


def make_workload(sessions: int, rate: float, seed: int) -> list[Session]:
    """Poisson arrivals; Pareto-distributed turn counts (alpha 1.3: most sessions short, a few
    very long) and log-normal turn lengths, as agent rollouts have."""
    rng = random.Random(seed)
    out, now = [], 0.0
    for i in range(sessions):
        now += rng.expovariate(rate)
        count = min(200, int(rng.paretovariate(1.2) * 5))
        turns = tuple(
            Turn(rng.lognormvariate(0.0, 1.0), rng.lognormvariate(0.5, 1.0)) for _ in range(count)
        )
        out.append(Session(f"session-{i}", now, turns))
    return out


# -- the simulation ------------------------------------------------------------------------


@dataclass
class Server:
    address: str
    eligible: bool = True
    paused: bool = False
    in_flight: int = 0  # turns generating here
    weight_version: int = 0  # one version throughout: nothing here is ever behind
    holds: set[str] = field(default_factory=set)  # sessions whose KV cache lives here

    @property
    def reported_load(self) -> int:
        return self.in_flight


@dataclass
class Outcome:
    policy: str
    ratios: list[float]  # max/mean live sessions, one sample per simulated second
    ratios_outside: list[float]  # the same, outside the membership change
    means: list[float]  # mean live sessions per server at each sample
    turns: int = 0
    stayed: int = 0
    turns_outside: int = 0
    stayed_outside: int = 0
    moves: Counter[str] = field(default_factory=Counter)  # phase -> turns that moved


def simulate(
    policy_name: str,
    workload: list[Session],
    servers: int,
    remove_at: float,
    readd_at: float,
    settle: float,
) -> Outcome:
    policy: PlacementPolicy = make_policy(policy_name)
    fleet = {f"server-{i}": Server(f"server-{i}") for i in range(servers)}
    for address in fleet:
        policy.add(address)
    directory = policy.sessions

    def finish_at(address: str, session: str) -> None:
        """FinishSession reached ``address``: it stops holding (and reporting) the session."""
        if session in fleet[address].holds:
            fleet[address].holds.discard(session)
            directory.report(address, (), [session])

    # The router tells the server a session left to forget it.
    policy.on_move = lambda session, left, went: finish_at(left, session)

    # Events: (time, order, kind, payload); order keeps the replay deterministic.
    events: list[tuple[float, int, str, object]] = []
    order = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal order
        heapq.heappush(events, (at, order, kind, payload))
        order += 1

    for session in workload:
        push(session.arrival_s, "turn", (session, 0, None))
    push(remove_at, "remove", "server-0")
    push(readd_at, "readd", "server-0")
    end = max(s.arrival_s for s in workload) + 10
    for second in range(int(end) + 600):
        push(float(second), "sample", None)

    outcome = Outcome(policy_name, [], [], [])
    last_server: dict[str, str] = {}
    pending = len(workload)
    while events and pending:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "sample":
            live = [len(s.holds) for s in fleet.values() if s.eligible]
            mean = sum(live) / len(live)
            if mean >= 20:
                outcome.ratios.append(max(live) / mean)
                outcome.means.append(mean)
                if not remove_at <= now <= readd_at + settle:
                    outcome.ratios_outside.append(max(live) / mean)
        elif kind == "remove":
            server = fleet[str(payload)]
            server.eligible = False
            policy.remove(server.address)
            server.holds.clear()  # its process is gone, and its KV cache with it
        elif kind == "readd":
            server = fleet[str(payload)]
            server.eligible = True
            policy.add(server.address)
        elif kind == "done":
            address, session_id = cast(tuple[str, str], payload)
            fleet[address].in_flight -= 1
        elif kind == "turn":
            session, index, _ = cast(tuple[Session, int, None], payload)
            chosen = policy.choose(session.sid, fleet)
            assert chosen is not None
            address = chosen.address
            if session.sid not in chosen.holds:
                chosen.holds.add(session.sid)
                directory.report(address, [session.sid])
            if not policy.sticky:
                # Consistent hashing never tells the server a session left; it would be
                # released by idleness there. Count only where its cache is warm.
                previous = last_server.get(session.sid)
                if previous is not None and previous != address:
                    fleet[previous].holds.discard(session.sid)
            if index > 0:
                stayed = last_server[session.sid] == address
                outside = not (remove_at <= now <= readd_at + settle)
                outcome.turns += 1
                outcome.stayed += stayed
                outcome.turns_outside += outside
                outcome.stayed_outside += stayed and outside
                if not stayed:
                    phase = (
                        "before removal"
                        if now < remove_at
                        else "server away"
                        if now < readd_at
                        else "after re-add"
                    )
                    outcome.moves[phase] += 1
            last_server[session.sid] = address
            turn = session.turns[index]
            chosen.in_flight += 1
            push(now + turn.generate_s, "done", (address, session.sid))
            if index + 1 < len(session.turns):
                push(now + turn.generate_s + turn.think_s, "turn", (session, index + 1, None))
            else:
                push(now + turn.generate_s, "finish", session.sid)
        elif kind == "finish":
            session_id = str(payload)
            home = last_server.pop(session_id)
            finish_at(home, session_id)
            directory.finish(session_id)
            pending -= 1
    return outcome


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulation_report(args: argparse.Namespace) -> list[str]:
    workload = make_workload(args.sessions, args.rate, args.seed)
    turns = sum(len(s.turns) for s in workload)
    longest = max(len(s.turns) for s in workload)
    lines = [
        "### Session placement (`python -m scripts.bench_placement`)",
        "",
        f"Simulation: {args.servers} servers, {len(workload)} sessions ({turns} turns, "
        f"median {statistics.median(len(s.turns) for s in workload):.0f} and at most {longest} "
        f"per session), Poisson arrivals at {args.rate}/s; server-0 removed at "
        f"{args.remove_at:.0f} s and added back at {args.readd_at:.0f} s; 'outside' excludes "
        f"turns from the removal to {args.settle:.0f} s after the re-add. Seed {args.seed}.",
        "",
        "| policy | live sessions per server (mean) | max/mean live sessions: mean | p99 | worst | worst outside the change "
        "| turns on their session's server: all | outside the change "
        "| moved turns: before / away / after re-add |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in POLICIES:
        o = simulate(name, workload, args.servers, args.remove_at, args.readd_at, args.settle)
        lines.append(
            f"| {name} | {statistics.fmean(o.means):.1f} | {statistics.fmean(o.ratios):.3f} | {percentile(o.ratios, 0.99):.3f} "
            f"| {max(o.ratios):.3f} | {max(o.ratios_outside):.3f} "
            f"| {100 * o.stayed / o.turns:.2f}% "
            f"| {100 * o.stayed_outside / o.turns_outside:.2f}% "
            f"| {o.moves['before removal']} / {o.moves['server away']} / "
            f"{o.moves['after re-add']} |"
        )
    return lines


# -- against real engines ------------------------------------------------------------------


async def engine_run(
    router: str, workload: list[Session], max_tokens: int, context: int = 500
) -> dict[str, float]:
    """Every session's turns in order, each prompt the previous prompt + output + a new
    observation (as an agent's transcript grows); sessions run concurrently."""
    from trainer_client import InferenceClient

    client = InferenceClient(router, direct=False)  # the router under test places every call
    rng = random.Random(7)
    totals: Counter[str] = Counter()
    start = time.perf_counter()

    async def one(session: Session) -> None:
        await asyncio.sleep(session.arrival_s)
        transcript = [rng.randrange(100, 2000) for _ in range(160)]
        for turn in session.turns:
            if len(transcript) + max_tokens > context:
                break  # the tiny model's context is full: the episode ends
            result = await client.generate(
                transcript,
                {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                session_id=session.sid,
            )
            totals["output"] += len(result.token_ids)
            totals["prompt"] += len(transcript)
            totals["cached"] += result.cached_prompt_tokens
            transcript = transcript + list(result.token_ids)
            observation = min(int(10 * turn.generate_s) + 8, 64)
            transcript += [rng.randrange(100, 2000) for _ in range(observation)]
            await asyncio.sleep(min(turn.think_s, 2.0) / 10)
        await client.finish_session(session.sid)

    await asyncio.gather(*(one(s) for s in workload))
    elapsed = time.perf_counter() - start
    await client.close()
    return {
        "tokens_per_s": totals["output"] / elapsed,
        "cached": totals["cached"],
        "prompt": totals["prompt"],
        "elapsed": elapsed,
    }


async def membership_change(router: Any, address: str, remove_at: float, readd_at: float) -> None:
    """``address`` leaves the router's membership at ``remove_at`` and is back at ``readd_at``
    (seconds from now), as an operator's RemoveBackend / AddBackend would do."""
    await asyncio.sleep(remove_at)
    await router.pool.remove(address)
    await asyncio.sleep(readd_at - remove_at)
    router.pool.add(address)
    await router.wait_healthy(len(router.pool.backends))


async def engines_report(args: argparse.Namespace) -> list[str]:
    from servers.fleet.local import LocalFleet
    from servers.router.router_server import RouterOptions, RouterServer

    workload = [
        Session(s.sid, s.arrival_s, s.turns[:12])
        for s in make_workload(args.engine_sessions, args.engine_rate, args.seed)
    ]
    lines = [
        "",
        f"Real engines: {args.engine_servers} engine servers (tiny model), {len(workload)} "
        f"sessions of up to {sum(len(s.turns) for s in workload)} turns of {args.max_tokens} "
        "output tokens, prompts growing turn by turn until the context is full; the last "
        f"server removed from the router at {args.engine_remove_at:.0f} s and added back at "
        f"{args.engine_readd_at:.0f} s; one router per policy over the same servers, "
        "alternating, each run twice.",
        "",
        "| policy | output tok/s | run time (s) | cached prompt tokens | share of prompt tokens cached |",
        "| --- | --- | --- | --- | --- |",
    ]
    results: dict[str, list[dict[str, float]]] = {}
    with LocalFleet(args.engine_servers) as stack:
        routers = {}
        for name in ("bounded-load", "consistent-hash"):
            router = RouterServer(
                RouterOptions(backends=list(stack.addresses.servers), port=0, placement=name)
            )
            await router.start()
            await router.wait_healthy(args.engine_servers)
            routers[name] = router
        try:
            warm = workload[:4]
            for router in routers.values():
                await engine_run(router.address, warm, args.max_tokens)
            for _ in range(2):
                for name, router in routers.items():
                    renamed = [
                        Session(
                            f"{name}-{s.sid}-{len(results.get(name, []))}", s.arrival_s, s.turns
                        )
                        for s in workload
                    ]
                    change = asyncio.ensure_future(
                        membership_change(
                            router,
                            stack.addresses.servers[-1],
                            args.engine_remove_at,
                            args.engine_readd_at,
                        )
                    )
                    results.setdefault(name, []).append(
                        await engine_run(router.address, renamed, args.max_tokens)
                    )
                    await change
        finally:
            for router in routers.values():
                await router.stop(0)
    for name, runs in results.items():
        tps = statistics.fmean(r["tokens_per_s"] for r in runs)
        cached = sum(r["cached"] for r in runs)
        prompt = sum(r["prompt"] for r in runs)
        elapsed = statistics.fmean(r["elapsed"] for r in runs)
        lines.append(
            f"| {name} | {tps:.0f} | {elapsed:.1f} | {cached:.0f} | {100 * cached / prompt:.1f}% |"
        )
    ratio = statistics.fmean(r["tokens_per_s"] for r in results["bounded-load"]) / statistics.fmean(
        r["tokens_per_s"] for r in results["consistent-hash"]
    )
    lines.append("")
    lines.append(f"bounded-load / consistent-hash output tok/s: {ratio:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=4.0, help="sessions arriving per second")
    parser.add_argument("--remove-at", type=float, default=100.0)
    parser.add_argument("--readd-at", type=float, default=140.0)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engines", action="store_true", help="also run against real engines")
    parser.add_argument("--engine-servers", type=int, default=3)
    parser.add_argument("--engine-sessions", type=int, default=36)
    parser.add_argument("--engine-rate", type=float, default=3.0)
    parser.add_argument("--engine-remove-at", type=float, default=4.0)
    parser.add_argument("--engine-readd-at", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    add_output_argument(parser, "serving.md")
    args = parser.parse_args()
    lines = simulation_report(args)
    print("\n".join(lines), flush=True)
    if args.engines:
        lines += asyncio.run(engines_report(args))
    write_report(args.output, lines, "bench_placement" + (" engines" if args.engines else ""))


if __name__ == "__main__":
    main()
