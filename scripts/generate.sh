#!/usr/bin/env bash
# Lints the contracts and regenerates skyrl_grpc/v1 from protos/ with buf.
# `scripts/generate.sh --check` regenerates and fails if the committed stubs differ (CI).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PATH="$root/.venv/bin:$PATH"
buf lint
buf build -o /dev/null
rm -rf skyrl_grpc/v1
buf generate
if [ "${1:-}" = "--check" ]; then
  if ! git diff --exit-code -- skyrl_grpc/v1 || [ -n "$(git status --porcelain -- skyrl_grpc/v1)" ]; then
    echo "generated stubs are out of date: run scripts/generate.sh and commit skyrl_grpc/v1" >&2
    exit 1
  fi
  echo "generated stubs are current"
fi
