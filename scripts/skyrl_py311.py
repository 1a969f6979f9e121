"""Makes the installed SkyRL (``skyrl``, ``skyrl-gym`` 0.4.0) importable on Python 3.11.

SkyRL declares Python >= 3.12; on 3.11 its code runs except for one thing: pydantic refuses the
``typing.TypedDict`` its modules build models from ("Please use typing_extensions.TypedDict").
This rewrites exactly those imports in SkyRL's own installed files: after each
``from typing import ... TypedDict ...`` it adds ``from typing_extensions import TypedDict``, so
SkyRL's modules bind the compatible class themselves, whichever module imports them first, and
nothing else in the process changes (``typing.TypedDict`` stays the standard library's).

Idempotent (a patched line is recognised by its marker); does nothing on Python >= 3.12.
``scripts/setup.sh`` runs it after installing SkyRL. Run: ``python scripts/skyrl_py311.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

PACKAGES = ("skyrl", "skyrl_gym")
MARKER = "# skyrl-grpc: pydantic needs this TypedDict on Python < 3.12"


def patched_source(source: str) -> str | None:
    """``source`` with a ``typing_extensions`` import after every ``typing`` import of
    ``TypedDict``, or None when it needs none (none there, or already patched)."""
    if "TypedDict" not in source or MARKER in source:
        return None
    lines = source.splitlines(keepends=True)
    inserts: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.module != "typing":
            continue
        for alias in node.names:
            if alias.name == "TypedDict":
                bound = f" as {alias.asname}" if alias.asname else ""
                line = f"{' ' * node.col_offset}from typing_extensions import TypedDict{bound}"
                assert node.end_lineno is not None
                inserts.append((node.end_lineno, f"{line}  {MARKER}\n"))
    if not inserts:
        return None
    for after, line in sorted(inserts, reverse=True):
        lines.insert(after, line)
    return "".join(lines)


def patch_package(name: str) -> list[Path]:
    """Patches one installed package; returns the files it changed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    changed = []
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            patched = patched_source(source)
            if patched is not None:
                path.write_text(patched, encoding="utf-8")
                changed.append(path)
    return changed


def main() -> None:
    if sys.version_info >= (3, 12):
        return
    for name in PACKAGES:
        for path in patch_package(name):
            print(f"[skyrl_py311] {path}: TypedDict from typing_extensions", file=sys.stderr)


if __name__ == "__main__":
    main()
