"""The command line, without starting engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.server_process import WITH_SIGINT_IGNORED, alive
from tests.helpers.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["serve", "route", "up", "scale", "demo"])
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "servers.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_the_demo_trainer_has_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainer_client.demo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--steps" in result.stdout and "--router" in result.stdout


def test_unknown_options_are_refused_except_the_trainers_of_demo() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "servers.cli", "route", "--no-such-flag"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "unrecognized arguments: --no-such-flag" in result.stderr


def _console_scripts() -> list[str]:
    from importlib.metadata import distribution

    entry_points = distribution("skyrl-grpc").entry_points
    return sorted(e.name for e in entry_points if e.group == "console_scripts")


def test_the_package_installs_console_scripts() -> None:
    assert "skyrl-grpc" in _console_scripts()


@pytest.mark.parametrize("script", _console_scripts())
def test_every_installed_console_script_runs(script: str) -> None:
    # The installed launcher, as a user types it: its entry point must import and parse.
    result = subprocess.run(
        [str(Path(sys.executable).with_name(script)), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_up_passes_every_serve_flag_to_every_server_locally_and_on_ray() -> None:
    """One rule for both fleets: the servers take `skyrl-grpc serve`'s flags; `up` checks the
    ones it passes through before anything starts."""
    from servers.cli import build_parser, make_fleet
    from servers.fleet.local import LocalFleet
    from servers.fleet.ray_actors import server_options
    from servers.fleet.ray_group import RayFleet
    from skyrl_grpc.tiny_model import tiny_model_path

    extra = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--data-token", "t",
             "--max-n", "4", "--dtype", "float32"]  # fmt: skip
    up = ["up", "--enable-lora", "--start-timeout", "1200", "--http-port", "8001",
          "--metrics-port", "9101", "--router-port", "7000", "--server-ports", "7001,7002",
          "--log-dir", "logs", "--router-replicas", "3",
          "--otlp-traces-endpoint", "127.0.0.1:4317"]  # fmt: skip
    args, rest = build_parser().parse_known_args([*up, *extra])
    assert rest == extra
    local = make_fleet(args, rest)
    assert isinstance(local, LocalFleet) and local.engine_args[-len(extra) :] == extra
    assert "--enable-lora" in local.engine_args
    assert local.start_timeout == 1200
    assert local.router_args[:2] == ["--replicas", "3"]
    # The edge tokenizes text prompts with the served model's files (the embedded model's).
    tokenizer = local.router_args[local.router_args.index("--tokenizer") + 1]
    assert tokenizer.endswith(str(tiny_model_path().name))
    traced = ["--otlp-traces-endpoint", "127.0.0.1:4317"]
    assert " ".join(traced) in " ".join(local.router_args) and traced[1] in local.engine_args
    args.ray = True
    ray_fleet = make_fleet(args, rest)
    assert isinstance(ray_fleet, RayFleet) and ray_fleet.start_timeout == 1200
    # The stack's own flags too: the edge, metrics, ports and logs (they were dropped on Ray).
    given = ray_fleet.options
    assert (given.http_port, given.metrics_port, given.router_port) == (8001, 9101, 7000)
    assert (list(given.server_ports or []), given.log_dir) == ([7001, 7002], "logs")
    assert given.router_replicas == 3
    assert given.otlp_traces_endpoint == "127.0.0.1:4317"
    assert given.tokenizer == tokenizer
    assert given.cpu_only  # vLLM's CPU build is installed here: no GPU asked for
    import ray

    assert not ray.is_initialized()  # Ray is only touched by start()
    options = server_options(ray_fleet.options.server_args, {"seed": 7}, "0.0.0.0")
    engine = options.engine
    assert engine.enable_lora and engine.tool_call_parser == "hermes"
    assert engine.enable_auto_tool_choice and engine.dtype == "float32" and engine.seed == 7
    assert options.data_token == "t" and options.limits.max_n == 4
    assert engine.otlp_traces_endpoint == "127.0.0.1:4317"
    assert (options.host, options.port) == ("0.0.0.0", 0)
    with pytest.raises(ValueError, match="--port"):
        server_options(["--port", "5"], {}, "127.0.0.1")


def test_up_gives_each_server_a_seed_of_its_own_from_the_one_it_is_given() -> None:
    """vLLM samples from one generator seeded with ``--seed``: servers seeded alike return the
    same samples for the same batch. Server i of a fleet gets ``--seed`` + i, locally (its
    command line, a restarted or standby server's too) and on Ray (engine options over the
    flags; ``test_ray_fleet`` samples on the actors)."""
    from servers.cli import build_parser, make_fleet
    from servers.engine.options import build_parser as serve_parser
    from servers.fleet.local import LocalFleet
    from servers.fleet.ray_group import RayFleet
    from servers.fleet.seeds import server_seed

    for given, first in (([], 0), (["--seed", "5"], 5), (["--seed=11"], 11)):
        args, rest = build_parser().parse_known_args(["up", "--servers", "2", "--standby", "1"])
        local = make_fleet(args, [*rest, *given])
        assert isinstance(local, LocalFleet)
        spawned: list[list[str]] = []

        def spawn(name: str, module: str, argv: list[str], into: list[list[str]] = spawned) -> None:
            into.append(argv)

        local._spawn = spawn  # type: ignore[method-assign,assignment]
        local.server_metrics_ports = [None] * 3  # no process to learn a metrics port from
        for index in (0, 1, 2, 1):  # the last: server 1 restarted in its place
            local._spawn_server(index, catch_up=index == 1)
        seeds = [serve_parser().parse_known_args(argv)[0].seed for argv in spawned]
        assert seeds == [first, first + 1, first + 2, first + 1], spawned
    # On Ray the engine options passed over the flags decide, seed included.
    for engine, first in (({"seed": 9}, 9), ({"dtype": "float32"}, 5)):
        ray_fleet = RayFleet(2, server_args=["--seed", "5"], engine=engine)
        seeds = [server_seed(ray_fleet._server.engine.seed, i) for i in range(2)]
        assert seeds == [first, first + 1], (engine, seeds)


def test_up_tells_its_router_when_its_servers_capture_routed_experts() -> None:
    """``up --enable-return-routed-experts`` (a server flag, vLLM's): the router's edge returns
    them (``route --routed-experts``), locally and on Ray; without it, the router asks none."""
    from servers.cli import build_parser, make_fleet
    from servers.fleet.local import LocalFleet
    from servers.fleet.ray_group import RayFleet
    from servers.router.router_server import build_parser as route_parser
    from servers.router.router_server import options_from_args

    for flags, told in ((["--enable-return-routed-experts"], True), ([], False)):
        args, rest = build_parser().parse_known_args(["up", *flags])
        local = make_fleet(args, rest)
        assert isinstance(local, LocalFleet)
        assert ("--routed-experts" in local.router_args) is told
        parsed = route_parser().parse_args(["--backends", "a:1", *local.router_args])
        assert options_from_args(parsed).routed_experts is told
        args.ray = True
        ray_fleet = make_fleet(args, rest)
        assert isinstance(ray_fleet, RayFleet)  # its router actor reads the flag from these
        assert ("--enable-return-routed-experts" in ray_fleet.options.server_args) is told


def test_up_standby_starts_warm_standbys_locally_and_on_ray_each_with_a_port() -> None:
    from servers.cli import build_parser, make_fleet
    from servers.fleet.local import LocalFleet
    from servers.fleet.ray_group import RayFleet

    up = ["up", "--servers", "2", "--standby", "1", "--server-ports", "7001,7002,7003"]
    args, rest = build_parser().parse_known_args(up)
    local = make_fleet(args, rest)
    assert isinstance(local, LocalFleet) and local.num_servers == 3
    assert local.server_ports == [7001, 7002, 7003] and local.roles.indexes == {2}
    args.ray = True
    ray_fleet = make_fleet(args, rest)
    assert isinstance(ray_fleet, RayFleet) and ray_fleet.options.num_servers == 3
    assert len(ray_fleet.bundles()) == 3 and ray_fleet.roles.indexes == {2}
    args, rest = build_parser().parse_known_args([*up[:-1], "7001,7002"])
    with pytest.raises(SystemExit, match="2 ports for --servers 2 \\+ --standby 1"):
        make_fleet(args, rest)


@pytest.mark.parametrize(
    ("flags", "words"),
    [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"), (["--port", "9"], "ports")],
)
def test_up_refuses_a_server_flag_it_cannot_pass(flags: list[str], words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "servers.cli", "up", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and words in result.stderr, result.stderr


@pytest.mark.slow
def test_the_demo_stops_on_sigint_even_started_with_it_ignored() -> None:
    """Started the way a script's background job is (SIGINT ignored on entry), the demo stops on
    SIGINT while its fleet starts, and the processes it had started are gone with it."""
    demo = subprocess.Popen(
        [
            *WITH_SIGINT_IGNORED,
            sys.executable,
            "-m",
            "servers.cli",
            "demo",
            "--servers",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,  # a group to signal; this session, as LocalFleet's servers
    )
    try:
        assert demo.stdout is not None
        first = demo.stdout.readline()
        assert first.startswith("starting 1 engine servers"), first
        wait_until(
            lambda: bool(psutil.Process(demo.pid).children(recursive=True)),
            what="the demo's fleet's first process",
        )
        started = psutil.Process(demo.pid).children(recursive=True)
        os.kill(demo.pid, signal.SIGINT)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the demo ignored SIGINT (Ctrl-C)") from None
        assert demo.returncode != 0, "the demo ran to its end: it ignored SIGINT (Ctrl-C)"
        wait_until(lambda: not alive(started), what="the demo's processes gone")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
