"""The architecture's boundaries are enforced: a deliberate violation fails the checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))
PACKAGES = ("servers", "trainer_client", "skyrl_grpc", "testbed")


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
            "import servers.engine.service.validate",
            "the engine server and the router never import each other",
        ),
        (
            "servers/engine/service/data_plane.py",
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
            "servers/engine/transfer/assembly.py",
            "from skyrl_grpc.v1 import control_plane_pb2",
            "below the servicers the engine speaks no protobuf",
        ),
        (
            "servers/engine/domain/live_sessions.py",
            "from skyrl_grpc.v1 import status_pb2",
            "below the servicers the engine speaks no protobuf",
        ),
        (
            "servers/engine/vllm_adapter/vllm_engine.py",
            "import servers.engine.service.validate",
            "the engine server's layers, one way down",
        ),
        (
            "servers/engine/service/data_plane.py",
            "import servers.engine.process.engine_parts",
            "the engine server's layers, one way down",
        ),
        (
            "servers/engine/domain/admission.py",
            "import servers.engine.service.batch_run",
            "the engine server's layers, one way down",
        ),
        (
            "servers/engine/worker/checkpoint.py",
            "import servers.engine.domain.weights.transaction",
            "the engine server's layers, one way down",
        ),
        (
            "trainer_client/weights/weight_sending.py",
            "import trainer_client.client",
            "the trainer's weight path is used by the client, never the reverse",
        ),
        (
            "servers/engine/domain/chat_output.py",
            "from vllm.parser import ParserManager",
            "the engine's domain never imports vLLM",
        ),
        (
            "servers/engine/peers/catch_up.py",
            "import servers.engine.service.control_convert",
            "the engine server's layers, one way down",
        ),
        (
            "servers/fleet/local.py",
            "import testbed",
            "nothing the product runs imports the testbed",
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


def generated(module: str) -> bool:
    return any(f".{package}" in module for package in GENERATED)


def import_cycles(packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """Every set of modules that import each other in a ring (an import in a function, or only
    for type checking, counts), generated stubs aside."""
    import grimp

    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if not generated(m))
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if generated(imported) or imported not in graph.modules:
                continue
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            ring = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                ring.append(member)
                if member == module:
                    break
            if len(ring) > 1:
                cycles.append(sorted(ring))

    for module in modules:
        if module not in order:
            visit(module)
    return cycles


def test_no_modules_import_each_other_in_a_ring() -> None:
    assert import_cycles() == []


def test_a_ring_of_imports_is_found(clean_tree: Path) -> None:
    """The check can fail: two modules that import each other are named."""
    path = clean_tree / "trainer_client" / "results.py"
    original = path.read_text()
    path.write_text(original + "\nimport trainer_client.batches  # deliberate ring\n")
    try:
        found = subprocess.run(
            [
                sys.executable,
                "-c",
                "from tests.project.test_architecture import import_cycles; print(import_cycles())",
            ],
            cwd=clean_tree,  # the copy's packages first; this test module from the project
            env={**os.environ, "PYTHONPATH": f"{clean_tree}:{ROOT}"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        path.write_text(original)
    assert "trainer_client.batches" in found.stdout and "trainer_client.results" in found.stdout, (
        found.stdout + found.stderr
    )


# A module a reader can hold: one concern, a few hundred lines.
MAX_MODULE_LINES = 450
# Generated stubs: ours (skyrl_grpc/v1) and vLLM's (skyrl_grpc/vllm_api, scripts/vllm_protos.py).
GENERATED = {"v1", "vllm_api"}


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for package in (*PACKAGES, "scripts")
        for path in (ROOT / package).rglob("*.py")
        if not GENERATED & set(path.relative_to(ROOT).parts)
        and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
