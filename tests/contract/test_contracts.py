"""The contract and its tooling: buf lint/build, current typed stubs, everything documented."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GENERATED = ROOT / "skyrl_grpc" / "v1"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[bytes]:
    # The venv's bin first: buf runs the codegen plugin with `python`.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    return subprocess.run(args, cwd=cwd, capture_output=True, env=env)


def test_buf_lint_is_clean() -> None:
    result = run(str(BIN / "buf"), "lint")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_regenerated_stubs_equal_committed(tmp_path: Path) -> None:
    # Generate into a copy of the repo's relevant files so the working tree is untouched.
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("buf.yaml", "buf.gen.yaml"):
        shutil.copy(ROOT / name, work / name)
    shutil.copytree(ROOT / "protos", work / "protos")
    shutil.copytree(ROOT / "scripts", work / "scripts")
    result = run(str(BIN / "buf"), "generate", cwd=work)
    assert result.returncode == 0, result.stderr.decode()
    fresh = work / "skyrl_grpc" / "v1"
    comparison = filecmp.dircmp(fresh, GENERATED, ignore=["__pycache__"])
    assert not comparison.left_only, f"not committed: {comparison.left_only}"
    assert not comparison.right_only, f"stale committed files: {comparison.right_only}"
    _, mismatch, errors = filecmp.cmpfiles(fresh, GENERATED, comparison.common_files, shallow=False)
    assert not mismatch and not errors, f"out of date (run scripts/generate.sh): {mismatch}"


def test_every_generated_module_has_type_stubs() -> None:
    modules = sorted(p for p in GENERATED.glob("*_pb2*.py"))
    assert len(modules) >= 8
    missing = [p.name for p in modules if not p.with_suffix(".pyi").exists()]
    assert not missing


def test_stubs_give_mypy_real_types(tmp_path: Path) -> None:
    snippet = tmp_path / "uses_stubs.py"
    snippet.write_text(
        "from skyrl_grpc.v1 import data_plane_pb2\n"
        "request = data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], n=2)\n"
        "count: int = request.n\n"
        "wrong: str = request.n\n"
    )
    result = run(sys.executable, "-m", "mypy", "--no-incremental", str(snippet))
    out = result.stdout.decode()
    # Exactly the deliberate mistake is reported: the stubs type fields precisely.
    assert "uses_stubs.py:4: error: Incompatible types in assignment" in out, out
    assert "uses_stubs.py:3" not in out, out


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    image = tmp_path / "image.binpb"
    result = run(str(BIN / "buf"), "build", "-o", str(image))
    assert result.returncode == 0, result.stderr.decode()
    return descriptor_pb2.FileDescriptorSet.FromString(image.read_bytes())


def test_every_message_field_enum_and_rpc_is_documented(tmp_path: Path) -> None:
    undocumented: list[str] = []
    files = [f for f in _descriptor_set(tmp_path).file if f.name.startswith("skyrl/")]
    assert {f.name.rsplit("/", 1)[1] for f in files} >= {
        "data_plane.proto",
        "control_plane.proto",
        "generation.proto",
        "router.proto",
    }
    for file in files:
        comments = {
            tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location
        }

        def check(
            path: tuple[int, ...], what: str, comments: dict[tuple[int, ...], str] = comments
        ) -> None:
            if not comments.get(path):
                undocumented.append(what)

        for mi, message in enumerate(file.message_type):
            check((4, mi), f"{file.name}: {message.name}")
            for fi, field in enumerate(message.field):
                check((4, mi, 2, fi), f"{message.name}.{field.name}")
        for ei, enum in enumerate(file.enum_type):
            check((5, ei), enum.name)
            for vi, value in enumerate(enum.value):
                check((5, ei, 2, vi), f"{enum.name}.{value.name}")
        for si, service in enumerate(file.service):
            check((6, si), service.name)
            for ri, rpc in enumerate(service.method):
                check((6, si, 2, ri), f"{service.name}.{rpc.name}")
    assert not undocumented, "undocumented: " + ", ".join(undocumented)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("SamplingParams", "temperature"),
        ("SamplingParams", "top_p"),
        ("SamplingParams", "top_k"),
        ("SamplingParams", "max_tokens"),
        ("SamplingParams", "seed"),
        ("SamplingParams", "logprobs"),
    ],
)
def test_fields_whose_default_is_not_zero_are_optional(message: str, field: str) -> None:
    from skyrl_grpc.v1 import generation_pb2

    descriptor = generation_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    assert descriptor.has_presence, f"{message}.{field} must be optional"


def test_enums_start_with_unspecified(tmp_path: Path) -> None:
    for file in _descriptor_set(tmp_path).file:
        if not file.name.startswith("skyrl/"):
            continue
        for enum in file.enum_type:
            assert enum.value[0].number == 0 and enum.value[0].name.endswith("_UNSPECIFIED")
