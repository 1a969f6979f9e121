#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the demo on the embedded tiny model.
# Extra arguments go to `skyrl-grpc demo` (see `skyrl-grpc demo --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/skyrl-grpc" demo "$@"
