"""keep_freed_memory: large blocks stop getting their own mappings, in this process and in
processes it starts; an operator's own MALLOC_* settings win."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Allocates a 64 MiB buffer and reports glibc's count of separately mapped blocks while it lives.
PROBE = """
import ctypes, json, os, sys
sys.path.insert(0, {root!r})
from skyrl_grpc.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "apply" else None
before = libc.mallinfo2().hblks
block = bytearray(64 << 20)
print(json.dumps({{"applied": applied, "mapped_blocks_added": libc.mallinfo2().hblks - before,
                  "env": {{k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}}}))
"""


def probe(mode: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    output = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=str(ROOT)), mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(output)
    return result


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's allocator knobs are Linux-only"
)


def test_by_default_a_large_block_gets_its_own_mapping() -> None:
    assert probe("leave")["mapped_blocks_added"] == 1


def test_kept_memory_serves_large_blocks_from_the_heap_and_passes_to_children() -> None:
    result = probe("apply")
    assert result["applied"] is True
    assert result["mapped_blocks_added"] == 0
    assert result["env"] == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def test_an_operators_own_setting_stands() -> None:
    result = probe("apply", MALLOC_TRIM_THRESHOLD_="1000")
    assert result["applied"] is False
    assert result["mapped_blocks_added"] == 1
    assert result["env"] == {"MALLOC_TRIM_THRESHOLD_": "1000"}
