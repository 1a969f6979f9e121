"""The nemesis (``testbed.nemesis``): its schedule and bookkeeping against a stand-in testbed
that records what it is told (the subject is the nemesis itself), then a short mixed run on a
real one: the whole workload (streams through the router, completions through its OpenAI edge,
an RL loop pushing weights every step) through a partition, a pair cut off, a flapping link
and a killed server host, the history checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from skyrl_grpc.tiny_model import ensure_tiny_model
from testbed import Host
from testbed.history import History, Update, check
from testbed.nemesis import KINDS, Nemesis, Planned, Roles
from testbed.stack import job_result, run_job, start_job
from tests.helpers.hosts import JOB_SECONDS, host_fleet, open_testbed


@dataclass
class RecordingBed:
    """Records the faults a nemesis starts and heals (its hosts are plain records)."""

    hosts: list[Host]
    broken: set[str] = field(default_factory=set)  # what is faulty now
    calls: list[str] = field(default_factory=list)

    def _did(self, what: str, broken: bool) -> None:
        self.calls.append(what)
        (self.broken.add if broken else self.broken.discard)(what.split(" ", 1)[1])

    def cut(self, host: Host, how: str = "drop") -> None:
        self._did(f"cut {host.name}", True)

    def heal(self, host: Host) -> None:
        self._did(f"heal {host.name}", False)

    def cut_between(self, a: Host, b: Host) -> None:
        self._did(f"cut_between {a.name}|{b.name}", True)

    def heal_between(self, a: Host, b: Host) -> None:
        self._did(f"heal_between {a.name}|{b.name}", False)

    def lose(self, host: Host, percent: float) -> None:
        self._did(f"lose {host.name}", percent > 0)

    def delay(self, host: Host, ms: float) -> None:
        self._did(f"delay {host.name}", ms > 0)

    def heal_all(self) -> None:
        self.calls.append("heal_all")
        self.broken.clear()


def _roles(restarted: list[str]) -> tuple[RecordingBed, Roles]:
    names = ["router", "trainer", "s0", "s1"]
    hosts = [Host(n, n, f"10.0.0.{i}", f"p{i}") for i, n in enumerate(names)]
    router, trainer, s0, s1 = hosts
    roles = Roles(router, trainer, {"a0": s0, "a1": s1}, lambda h: restarted.append(h.name))
    return RecordingBed(hosts), roles


def test_a_schedule_is_the_seeds_covers_every_kind_and_never_kills_the_router() -> None:
    bed, roles = _roles([])
    nemesis = Nemesis(bed, roles)  # type: ignore[arg-type]  # a stand-in bed
    planned = nemesis.schedule(3600, seed=5)
    assert planned == nemesis.schedule(3600, seed=5) != nemesis.schedule(3600, seed=6)
    assert {p.kind for p in planned} == set(KINDS)
    assert not any(p.kind == "kill" and p.hosts == (roles.router,) for p in planned)
    assert all(5 <= p.seconds <= 15 and 5 <= p.after <= 20 for p in planned)


def test_each_fault_is_healed_and_tells_the_checker_whom_the_router_lost() -> None:
    restarted: list[str] = []
    bed, roles = _roles(restarted)
    nemesis = Nemesis(bed, roles)  # type: ignore[arg-type]
    router, trainer, s0, s1 = bed.hosts
    for kind, hosts in [
        ("partition", (s0,)),
        ("link-down", (router,)),
        ("pair", (trainer, s1)),
        ("pair", (router, s1)),
        ("loss-delay", tuple(bed.hosts)),
        ("kill", (s1,)),
    ]:
        fault = nemesis.apply(kind, hosts, 0.01)
        assert bed.broken == set(), (kind, bed.calls)  # healed before apply returns
        assert fault.started < fault.healed
    assert restarted == ["s1"]  # a killed host's server, started again
    # The router's own link down: both servers out of its reach; a trainer <-> server pair and
    # loss everywhere: none.
    outages = nemesis.outages()
    assert [o.server for o in outages] == ["a0", "a0", "a1", "a1", "a1"]
    assert all(o.start < o.end for o in outages)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("cut_out", [False, True], ids=["waiting", "cutting out"])
async def test_a_mixed_run_of_faults_loses_nothing_and_every_host_ends_at_one_version(
    tmp_path_factory: pytest.TempPathFactory, cut_out: bool
) -> None:
    """The RL loop either waits for (retries) a server it cannot reach, or cuts it out
    (``cut_out_unreachable``): either way nothing is lost, every update ends on one version
    among the servers it reached, and every host ends on the last one."""
    logs = tmp_path_factory.mktemp("nemesis-logs")
    with open_testbed() as bed:
        fleet = host_fleet(bed, logs)
        by_address = dict(zip(fleet.addresses, fleet.servers, strict=True))
        roles = Roles(
            fleet.router_host,
            fleet.trainer,
            by_address,
            lambda host: fleet.restart(host, logs),
            fleet.client,
        )
        nemesis = Nemesis(bed, roles)
        s0, s1 = fleet.servers
        planned = [
            Planned("partition", (s0,), 5, after=3),
            Planned("pair", (fleet.trainer, s1), 5, after=3),
            Planned("flap", (fleet.router_host,), 7, after=3),
            Planned("kill", (s1,), 3, after=3),
        ]
        # The kill's restart, 20 s. A server still cut out then is asked again after
        # ASK_AGAIN_SECONDS and taken back: the loop steps on until an update reaches every
        # server (whole_seconds).
        seconds = sum(p.seconds + p.after for p in planned) + 20
        common = {"seconds": seconds, "deadline": 120.0}
        streams = start_job(
            fleet.client,
            "streams",
            {"address": fleet.router, "streams": 3, "tokens": 64, **common},
            logs,
        )
        rl = start_job(
            fleet.trainer,
            "rl",
            {"router": fleet.router, "servers": fleet.addresses,
             "model": str(ensure_tiny_model()), "seconds": seconds, "retry_seconds": 180,
             "whole_seconds": 120,
             "client": {"cut_out_unreachable": cut_out}},
            logs,
        )  # fmt: skip
        nemesis.run(planned)
        nemesis.join(600)
        results = {"streams": job_result(streams, 900), "rl": job_result(rl, 900)}
        end = run_job(fleet.client, "info", {"servers": fleet.addresses}, JOB_SECONDS)
    history = History.from_json(results["streams"]["history"])
    history.updates = [Update(**u) for u in results["rl"]["updates"]]
    history.outages = nemesis.outages()
    assert [str(v) for v in check(history)] == []
    last = {c.key: c for c in sorted(history.calls, key=lambda c: c.started)}
    assert all(call.status == "OK" for call in last.values())
    assert [f.kind for f in nemesis.faults] == [p.kind for p in planned]
    rl_result = results["rl"]
    assert rl_result["given_up"] == [] and rl_result["rewards"], rl_result
    assert rl_result["left_out_at_the_end"] == {}, rl_result["left_out_at_the_end"]
    committed = [u for u in history.updates if u.committed]
    assert committed, history.updates
    # Every host back, on the version the RL loop committed last.
    assert {found.get("version") for found in end.values()} == {committed[-1].version}, end
    cut = sum(1 for u in committed if u.unreachable)
    print(
        f"{len(last)} streams ({len(history.calls) - len(last)} retried), "
        f"{len(rl_result['rewards'])} RL steps, {len(committed)} updates committed "
        f"({cut} with a server cut out), {len(history.updates) - len(committed)} failed and "
        "retried"
    )
