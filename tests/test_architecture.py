"""The architecture's boundaries are enforced: a deliberate violation fails the checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))
PACKAGES = ("servers", "trainer_client", "skyrl_grpc")


def _copy_tree(target: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    return target


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages that passes the contracts (checked once: each test breaks one
    contract in it and puts the module back)."""
    tree = _copy_tree(tmp_path_factory.mktemp("tree"))
    clean = _lint_imports(tree)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    return tree


@pytest.mark.parametrize(
    ("module", "violation", "contract"),
    [
        (
            "servers/router/proxy.py",
            "import servers.engine.validate",
            "the engine server and the router never import each other",
        ),
        (
            "servers/engine/data_plane.py",
            "from servers.router import hash_ring",
            "the engine server and the router never import each other",
        ),
        (
            "trainer_client/client.py",
            "import servers.fleet",
            "what a trainer imports never imports the servers",
        ),
        (
            "servers/cli.py",
            "import trainer_client.demo",
            "the servers never import the trainer client",
        ),
        (
            "servers/engine/weights/assembly.py",
            "from skyrl_grpc.v1 import control_plane_pb2",
            "the engine's domain and its vLLM adapter speak no protobuf",
        ),
        (
            "servers/engine/vllm_engine.py",
            "import servers.engine.validate",
            "the engine's domain and its vLLM adapter speak no protobuf",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    clean_tree: Path, module: str, violation: str, contract: str
) -> None:
    path = clean_tree / module
    original = path.read_text()
    path.write_text(original + f"\n{violation}  # deliberate violation\n")
    try:
        broken = _lint_imports(clean_tree)
    finally:
        path.write_text(original)  # the next test starts from the clean copy again
    assert broken.returncode != 0
    assert f"{contract} BROKEN" in broken.stdout


# A module a reader can hold: one concern, a few hundred lines.
MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "v1" not in path.relative_to(ROOT).parts  # generated stubs
        and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
