"""vLLM's own contract is taken from vLLM's release, checked file by file
(``scripts/vllm_protos.py``): what setup generated is the pinned release's, and a file that
differs from its pinned SHA-256 is refused, naming it, before anything is generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import vllm_protos
from skyrl_grpc.vllm_api import control_pb2, inference_pb2


def test_the_generated_stubs_are_the_pinned_releases() -> None:
    stamp = vllm_protos.STAMP.read_text()
    assert stamp.startswith(f"vllm {vllm_protos.VLLM_RELEASE} ")
    assert all(digest in stamp for digest in vllm_protos.FILES.values())
    assert control_pb2.DESCRIPTOR.package == inference_pb2.DESCRIPTOR.package == "vllm"
    methods = control_pb2.DESCRIPTOR.services_by_name["Control"].methods_by_name
    assert {"PauseGeneration", "InitWeightTransferEngine", "GetWeightVersion"} <= set(methods)


def test_a_file_that_is_not_the_pinned_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(vllm_protos, "MODULE", tmp_path / "vllm-proto")
    monkeypatch.setitem(vllm_protos.FILES, "control.proto", "0" * 64)
    with pytest.raises(SystemExit) as refused:
        vllm_protos._unpack()
    assert "rust/proto/control.proto: SHA-256" in str(refused.value)
    assert not (tmp_path / "vllm-proto").exists()
