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
# Two workers (SKYRL_TEST_WORKERS; 0 runs in this process): on its own the suite keeps about 40%
# of two cores busy, the rest is waiting on engines, sockets and processes it starts. Each file
# runs on one worker (tests/conftest.py groups them), so a module's fixtures start once.
exec python -m pytest -q -ra -n "${SKYRL_TEST_WORKERS:-2}" "$@"
