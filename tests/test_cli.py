"""The command line, without starting engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", ["serve", "route", "up", "demo"])
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
