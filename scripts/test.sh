#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the whole test suite. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not engine"` for the quick loop.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
export PATH="$root/.venv/bin:$PATH"
exec python -m pytest -q -ra "$@"
