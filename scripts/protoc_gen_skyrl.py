"""buf/protoc plugin that generates the ``skyrl_grpc.v1`` Python package from ``protos/``.

Reads a ``CodeGeneratorRequest`` on stdin and writes a ``CodeGeneratorResponse`` on stdout, like
any protoc plugin. Inside, it runs the protoc compiler bundled with ``grpcio-tools`` (messages,
``.pyi`` and gRPC stubs) and ``mypy-protobuf``'s gRPC stub generator, then moves the files from
``skyrl/inference/v1/`` to ``v1/`` and roots their imports at ``skyrl_grpc.v1``: the proto package
keeps its versioned name on the wire while Python code imports ``skyrl_grpc.v1.data_plane_pb2``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc

PROTO_DIR = "skyrl/inference/v1/"
PYTHON_PACKAGE = "skyrl_grpc.v1"
# Module references to rewrite: `from skyrl.inference.v1 import x_pb2` and the dotted
# `skyrl.inference.v1.x_pb2` form. Message full names in the serialized descriptors never end
# in `_pb2`, so the wire names stay untouched.
_FROM_IMPORT = re.compile(r"\bfrom skyrl\.inference\.v1 import\b")
_DOTTED_MODULE = re.compile(r"\bskyrl\.inference\.v1\.(\w+_pb2(?:_grpc)?)\b")
PACKAGE_INIT = '"""Generated from protos/skyrl/inference/v1 by buf generate; do not edit."""\n'


def _rewrite(content: str) -> str:
    content = _FROM_IMPORT.sub(f"from {PYTHON_PACKAGE} import", content)
    return _DOTTED_MODULE.sub(rf"{PYTHON_PACKAGE}.\1", content)


def _protoc_outputs(request: plugin_pb2.CodeGeneratorRequest) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = descriptor_pb2.FileDescriptorSet(file=request.proto_file)
        set_path = Path(tmp, "descriptors.binpb")
        set_path.write_bytes(descriptor_set.SerializeToString())
        out = Path(tmp, "out")
        out.mkdir()
        args = [
            "protoc",
            f"--descriptor_set_in={set_path}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *request.file_to_generate,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("grpc_tools.protoc failed")
        return {
            str(path.relative_to(out)): path.read_text()
            for path in sorted(out.rglob("*"))
            if path.is_file()
        }


def _mypy_grpc_outputs(request: plugin_pb2.CodeGeneratorRequest) -> dict[str, str]:
    plugin = Path(sys.executable).with_name("protoc-gen-mypy_grpc")
    result = subprocess.run(
        [str(plugin)], input=request.SerializeToString(), capture_output=True, check=True
    )
    response = plugin_pb2.CodeGeneratorResponse.FromString(result.stdout)
    if response.error:
        raise SystemExit(f"protoc-gen-mypy_grpc: {response.error}")
    return {f.name: f.content for f in response.file}


def main() -> None:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    outputs = {**_protoc_outputs(request), **_mypy_grpc_outputs(request)}
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    for name, content in sorted(outputs.items()):
        if not name.startswith(PROTO_DIR):
            raise SystemExit(f"unexpected output outside {PROTO_DIR}: {name}")
        response.file.add(name="v1/" + name[len(PROTO_DIR) :], content=_rewrite(content))
    response.file.add(name="v1/__init__.py", content=PACKAGE_INIT)
    sys.stdout.buffer.write(response.SerializeToString())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
