"""Every code example in the README and docs/ runs as written, against a real fleet: each Python
block as a program of its own, each block of grpcurl / curl commands through a shell. A page
addresses the fleet `skyrl-grpc up --servers 2 --http-port 8000 --admin-port 50049` starts
(router :50050, servers :50051 and :50052, the OpenAI edge :8000, FleetAdmin :50049); the fleet
here listens where it could, so those addresses, and only those, are replaced before a block
runs.

Blocks that start processes (``skyrl-grpc ...``, ``ray start``, ``pip install``) are not run:
tests/project/test_docs.py parses every ``skyrl-grpc`` command with today's flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers.fleet.admin import FleetScaler, serve
from servers.fleet.local import LocalFleet
from tests.helpers.waits import ENGINE_START_SECONDS, FLEET_TEST_TIMEOUT

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUN_IN_SHELL = ("grpcurl ", "curl ")
# Seconds one example may take (the README's loop trains three steps; imports take ~10 s).
EXAMPLE_SECONDS = 300


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    """The runnable blocks: Python, and shell blocks made only of grpcurl / curl commands."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            language, code = match.group(1), match.group(2)
            line = text[: match.start()].count("\n") + 1
            commands = [c for c in code.replace("\\\n", " ").splitlines() if c.strip()]
            runnable = language == "python" or (
                language == "bash"
                and commands
                and all(c.startswith(RUN_IN_SHELL) for c in commands)
            )
            if runnable:
                found.append(Example(page.relative_to(ROOT).as_posix(), line, language, code))
    return found


def test_the_pages_hold_examples_of_every_kind() -> None:
    """The extraction is not empty by accident."""
    names = {e.name.split(":")[0] for e in examples()}
    assert {"README.md", "docs/training.md", "docs/serving.md", "docs/skyrl.md"} <= names
    assert {e.language for e in examples()} == {"python", "bash"}


@dataclass(frozen=True)
class DocFleet:
    router: str
    servers: tuple[str, ...]
    http_port: int
    admin: str  # its FleetAdmin (`up --admin-port 50049`)

    def addressed(self, code: str) -> str:
        """``code`` with the documented addresses replaced by this fleet's."""
        for host in ("127.0.0.1", "localhost"):
            code = code.replace(f"http://{host}:8000", f"http://127.0.0.1:{self.http_port}")
            code = code.replace(f"{host}:50049", self.admin)
            code = code.replace(f"{host}:50050", self.router)
            for index, server in enumerate(self.servers):
                code = code.replace(f"{host}:{50051 + index}", server)
        return code


@pytest.fixture(scope="module")
def doc_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocFleet]:
    """`skyrl-grpc up --servers 2 --http-port 8000 --admin-port 50049 --enable-lora`, on free
    ports."""
    fleet = LocalFleet(
        2,
        engine_args=["--enable-lora"],
        router_args=["--http-port", "0"],
        log_dir=tmp_path_factory.mktemp("doc-fleet"),
    )
    fleet.start(timeout=ENGINE_START_SECONDS)
    admin, admin_port = serve(FleetScaler(fleet.scale, lambda: fleet.addresses), "127.0.0.1", 0)
    try:
        assert fleet.http_port is not None
        addresses = fleet.addresses
        admin_address = f"127.0.0.1:{admin_port}"
        yield DocFleet(addresses.router, addresses.servers, fleet.http_port, admin_address)
    finally:
        admin.stop(grace=None)
        fleet.close()


@pytest.mark.timeout(FLEET_TEST_TIMEOUT)
@pytest.mark.parametrize("example", examples(), ids=lambda e: e.name)
def test_the_example_runs_as_written(doc_fleet: DocFleet, example: Example, tmp_path: Path) -> None:
    code = doc_fleet.addressed(example.code)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    if example.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    result = subprocess.run(
        command,
        cwd=tmp_path,  # not the repository: an example imports the installed packages
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_SECONDS,
    )
    assert result.returncode == 0, (
        f"{example.name} failed:\n{code}\n--- stdout\n{result.stdout[-2000:]}"
        f"\n--- stderr\n{result.stderr[-4000:]}"
    )
