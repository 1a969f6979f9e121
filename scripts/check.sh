#!/usr/bin/env bash
# Static checks, each of which fails the test command: ruff (lint and format), mypy --strict on our
# packages, the testbed, the scripts and the tests (generated stubs excluded), and the import
# contracts of pyproject.toml (engine and router never import each other; the client never imports the
# servers; ...).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin="$root/.venv/bin"
echo "[check] ruff" >&2
"$bin/ruff" check --quiet .
"$bin/ruff" format --check --quiet .
echo "[check] mypy --strict" >&2
"$bin/mypy" --no-error-summary
echo "[check] import contracts" >&2
"$bin/lint-imports" --no-cache >/dev/null || "$bin/lint-imports" --no-cache
