"""A peer's in-band streams as plain values: the messages of PushWeights, ReadWeights (what a
server catching up reads from a peer) and the adapter streams, each as the assembler takes it
(``transfer.specs.Manifest`` or a ``WireChunk``), and an adapter stream's spec. The service's
converters and the server as its peers' client (catch-up) read them the same way; shape only
(which oneof a message carries, a dtype the contract knows), the model's rules are
``transfer.assembly``'s.
"""

from __future__ import annotations

from servers.engine.domain.lora_adapters import AdapterSpec
from servers.engine.transfer.specs import Manifest, ParameterSpec, PatchSpec
from skyrl_grpc import dtypes
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import control_plane_pb2 as cp


def parameter_spec(spec: cp.ParameterSpec) -> ParameterSpec:
    patch = None
    if spec.HasField("patch"):
        patch = PatchSpec(
            base_weight_version=spec.patch.base_weight_version,
            changed=spec.patch.changed,
            bitmap=spec.patch.bitmap,
            zstd_bytes=spec.patch.zstd_bytes,
        )
    return ParameterSpec(
        name=spec.name,
        dtype=dtypes.from_proto(spec.dtype, f"dtype of {spec.name}"),
        shape=tuple(spec.shape),
        sha256=spec.sha256,
        patch=patch,
    )


def manifest(message: cp.WeightManifest) -> Manifest:
    return Manifest(tuple(parameter_spec(spec) for spec in message.parameters))


# The messages of an in-band stream: a manifest, then chunks, in a oneof named ``item``.
StreamMessage = (
    cp.PushWeightsRequest
    | cp.LoadLoraAdapterRequest
    | cp.ReadWeightsResponse
    | cp.ReadLoraAdapterResponse
)
# An adapter's stream: LoadLoraAdapter's, or ReadLoraAdapter's (the same items, the same order).
AdapterMessage = cp.LoadLoraAdapterRequest | cp.ReadLoraAdapterResponse


def stream_item(message: StreamMessage | WireChunk, refusal: str) -> Manifest | WireChunk:
    """An in-band stream's message (as protobuf parsed it, or a chunk ``decode_push_request``
    read) as the assembler takes it; INVALID_ARGUMENT saying ``refusal`` if it carries
    neither a manifest nor a chunk."""
    if isinstance(message, WireChunk):
        return message
    kind = message.WhichOneof("item")
    if kind == "manifest":
        return manifest(message.manifest)
    if kind == "chunk":
        return WireChunk.from_proto(message.chunk)
    raise InvalidArgument(refusal)


def push_item(message: cp.PushWeightsRequest | WireChunk) -> Manifest | WireChunk:
    """A PushWeights message as the assembler takes it."""
    return stream_item(message, "a PushWeights message must carry a manifest or a chunk")


def adapter_spec(message: AdapterMessage) -> AdapterSpec:
    """The spec an adapter's stream must open with."""
    if message.WhichOneof("item") != "spec":
        raise InvalidArgument("the first LoadLoraAdapter message must be the spec")
    spec = message.spec
    return AdapterSpec(
        name=spec.name, path=spec.path, config_json=spec.config_json, version=spec.version
    )


def adapter_item(message: AdapterMessage | WireChunk) -> Manifest | WireChunk:
    """An adapter's stream message after the spec: its manifest or one of its chunks."""
    return stream_item(message, "after the spec, send a manifest, then chunks")


def read_item(message: cp.ReadWeightsResponse) -> Manifest | WireChunk:
    """A ReadWeights message as the assembler of a PushWeights stream takes it (a server
    catching up pushes what it reads into itself)."""
    return stream_item(message, "a ReadWeights message must carry a manifest or a chunk")
