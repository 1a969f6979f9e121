#!/usr/bin/env bash
# Sets up .venv (idempotent), checks the code (ruff, mypy --strict, the import contracts of the
# architecture), then runs the whole test suite. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not engine and not slow"` for the quick loop.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
export PATH="$root/.venv/bin:$PATH"
bash "$root/scripts/check.sh"
exec python -m pytest -q -ra "$@"
