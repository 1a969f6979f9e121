"""The control plane's converters: weight-update and adapter messages from the wire into the
domain's plain values (``transfer.specs``, ``lora_adapters.AdapterSpec``), and checksums, the
serving weights (ReadWeights), a loaded adapter (ReadLoraAdapter, ListLoraAdapters) and what
the server says about itself (GetServerInfo) back.

Only shape is checked here (which oneof a message carries, a dtype the contract knows); what
the values must be for this model is ``transfer.assembly``'s and ``lora_adapters.checks``' to
say.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable, Iterator

from servers.engine.domain.descriptions import ServerDescription
from servers.engine.domain.lora_adapters import AdapterCopy
from servers.engine.domain.weights.relay_role import (
    MIN_TICKET_BYTES,
    RelayRole,
    RelayTarget,
    RelayTree,
)
from servers.engine.peers.stream_items import (
    parameter_spec,
    push_item,
)
from servers.engine.service.vllm_control_convert import CONTROL as VLLM_CONTROL
from servers.engine.service.vllm_inference_convert import INFERENCE as VLLM_INFERENCE
from servers.engine.service.vllm_protocol import VLLM_ENGINE
from servers.engine.transfer.assembly import ParamLayout
from servers.engine.transfer.protocol import Checksum
from servers.engine.transfer.specs import BucketSpec, Manifest, PackedParameter
from skyrl_grpc import dtypes
from skyrl_grpc.chunk_wire import WireChunk
from skyrl_grpc.crc import crc32
from skyrl_grpc.errors import InvalidArgument, PermissionDenied
from skyrl_grpc.metadata import PUSH_TICKET, RELAY_TREE, RELAYED_FROM
from skyrl_grpc.names import CONTROL_PLANE, DATA_PLANE, SERVER_STATUS
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import lora_pb2


def bucket_spec(bucket: cp.WeightBucket) -> BucketSpec:
    return BucketSpec(
        parameters=tuple(
            PackedParameter(parameter_spec(packed.parameter), packed.offset_bytes)
            for packed in bucket.parameters
        ),
        size_bytes=bucket.size_bytes,
    )


def bucket_specs(request: cp.UpdateWeightsRequest) -> list[BucketSpec]:
    return [bucket_spec(bucket) for bucket in request.buckets]


def relay_role(request: cp.StartWeightUpdateRequest) -> RelayRole | None:
    """The server's place in the update's relay plan (None: the trainer streams to it): one
    tree (``parent``, ``children``) or several (``trees``)."""
    if not request.HasField("relay"):
        return None
    role = request.relay
    if role.trees:
        trees = tuple(
            RelayTree(tree.parent, _relay_targets(tree.children, f"relay.trees[{i}]"))
            for i, tree in enumerate(role.trees)
        )
        named = True
    else:
        trees = (RelayTree(role.parent, _relay_targets(role.children, "relay")),)
        named = False
    forwards = any(tree.children for tree in trees)
    if forwards and not role.address:
        raise InvalidArgument(
            "relay.address is empty: a server that forwards names itself to its children"
        )
    if forwards and not request.push_ticket:
        raise InvalidArgument(
            "relay without push_ticket: a relay plan names every server's ticket beforehand, "
            "so the trainer chooses them"
        )
    return RelayRole(role.address, trees, named)


def _relay_targets(children: Iterable[cp.WeightRelayTarget], where: str) -> tuple[RelayTarget, ...]:
    targets = tuple(
        RelayTarget(child.address, child.push_socket_port, child.push_ticket) for child in children
    )
    for child in targets:
        if not child.address or len(child.ticket) < MIN_TICKET_BYTES:
            raise InvalidArgument(
                f"{where}.children: {child.address or 'a child with no address'} needs its "
                f"address and its push_ticket ({MIN_TICKET_BYTES} bytes or more)"
            )
    return targets


async def push_messages(
    messages: AsyncIterator[tuple[bytes, cp.PushWeightsRequest | WireChunk]],
) -> AsyncIterator[tuple[bytes, Manifest | WireChunk]]:
    """PushWeights' messages, each with its bytes as received (what a relay forwards)."""
    async for raw, message in messages:
        yield raw, push_item(message)


def stream_sender(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[bytes | None, str, int | None]:
    """A PushWeights call's ticket (None: the trainer's call, authorised by its channel), the
    peer relaying it ("": none) and the relay tree it names (None: none), from its metadata."""
    ticket: bytes | None = None
    relayed_from = ""
    tree: int | None = None
    for key, value in metadata or ():
        if key == PUSH_TICKET and isinstance(value, bytes):
            ticket = value
        elif key == RELAYED_FROM and isinstance(value, str):
            relayed_from = value
        elif key == RELAY_TREE and isinstance(value, str):
            if not value.isdigit():
                raise InvalidArgument(f"{RELAY_TREE} {value!r}: a relay tree's index (0, 1, ...)")
            tree = int(value)
    if relayed_from and ticket is None:
        raise PermissionDenied(
            f"a stream relayed from {relayed_from} without the update's ticket "
            f"({PUSH_TICKET}): refused, nothing staged"
        )
    return ticket, relayed_from, tree


def read_manifest(
    version: int, parameters: list[tuple[str, ParamLayout, bytes]]
) -> cp.ReadWeightsResponse:
    """The first message of a ReadWeights stream."""
    return cp.ReadWeightsResponse(
        weight_version=version,
        manifest=cp.WeightManifest(
            parameters=[
                cp.ParameterSpec(
                    name=name, dtype=layout.dtype.proto, shape=list(layout.shape), sha256=sha256
                )
                for name, layout, sha256 in parameters
            ]
        ),
    )


def read_chunks(
    version: int, name: str, data: bytes, chunk_bytes: int
) -> Iterator[cp.ReadWeightsResponse]:
    """One parameter's bytes as ReadWeights chunks, each with its crc32."""
    for chunk in _chunks(name, data, chunk_bytes):
        yield cp.ReadWeightsResponse(weight_version=version, chunk=chunk)


def _chunks(name: str, data: bytes, chunk_bytes: int) -> Iterator[cp.WeightChunk]:
    view = memoryview(data)
    for offset in range(0, len(view), chunk_bytes):
        piece = view[offset : offset + chunk_bytes]
        yield cp.WeightChunk(name=name, offset_bytes=offset, data=bytes(piece), crc32=crc32(piece))


def adapter_read(copy: AdapterCopy, chunk_bytes: int) -> Iterator[cp.ReadLoraAdapterResponse]:
    """A loaded adapter as a ReadLoraAdapter stream: the spec, the manifest (SHA-256 per
    tensor), then each tensor's chunks."""
    spec = copy.spec
    yield cp.ReadLoraAdapterResponse(
        spec=cp.LoraAdapterSpec(name=spec.name, config_json=spec.config_json, version=spec.version)
    )
    yield cp.ReadLoraAdapterResponse(
        manifest=cp.WeightManifest(
            parameters=[
                cp.ParameterSpec(
                    name=name,
                    dtype=dtypes.BY_TORCH[dtype].proto,
                    shape=list(shape),
                    sha256=hashlib.sha256(data).digest(),
                )
                for name, dtype, shape, data in copy.tensors
            ]
        )
    )
    for name, _, _, data in copy.tensors:
        for chunk in _chunks(name, data, chunk_bytes):
            yield cp.ReadLoraAdapterResponse(chunk=chunk)


def checksum_to_proto(row: Checksum) -> cp.ParameterChecksum:
    return cp.ParameterChecksum(
        name=row["name"],
        sha256=row["sha256"],
        dtype=dtypes.BY_TORCH[row["dtype"]].proto,
        shape=row["shape"],
    )


_BACKENDS = {
    "nccl": cp.WEIGHT_TRANSFER_BACKEND_NCCL,
    "gloo": cp.WEIGHT_TRANSFER_BACKEND_GLOO,
    "grpc_stream": cp.WEIGHT_TRANSFER_BACKEND_GRPC_STREAM,
}
_PAUSE_MODES = {
    "abort": cp.PAUSE_MODE_ABORT,
    "wait": cp.PAUSE_MODE_WAIT,
    "keep": cp.PAUSE_MODE_KEEP,
}


# The gRPC services an engine server answers (``process.engine_server`` registers each).
PROTOCOLS = (DATA_PLANE, CONTROL_PLANE, SERVER_STATUS, VLLM_ENGINE, VLLM_INFERENCE, VLLM_CONTROL)


def server_info_to_proto(server: ServerDescription) -> cp.GetServerInfoResponse:
    limits = server.lora
    info = cp.GetServerInfoResponse(
        world_size=server.world_size,
        weight_group_ranks=server.weight_group_ranks,
        tensor_parallel_size=server.tensor_parallel_size,
        pipeline_parallel_size=server.pipeline_parallel_size,
        data_parallel_size=server.data_parallel_size,
        capabilities=cp.Capabilities(
            sleep=server.sleep_supported,
            weight_transfer_backends=[_BACKENDS[b] for b in server.weight_transfer_backends],
            pause_modes=[_PAUSE_MODES[m] for m in server.pause_modes],
            prefix_caching=server.prefix_caching,
            compressed_weight_patches=True,
            weight_relay=True,
            weight_relay_trees=True,
            protocols=list(PROTOCOLS),
            routed_experts=server.routed_experts,
            lora=lora_pb2.LoraCapabilities(
                enabled=limits.enabled,
                max_loras=limits.max_loras,
                max_lora_rank=limits.max_lora_rank,
                max_cpu_loras=limits.max_cpu_loras,
            ),
        ),
        weight_version=server.weight_version,
        engine=server.engine,
        engine_version=server.engine_version,
        server_version=server.server_version,
        served_model_name=server.served_model_name,
        device=server.device,
    )
    group, open_update = server.group, server.open_update
    if group is not None:
        info.weight_transfer_group.CopyFrom(
            cp.WeightTransferGroup(
                group_name=group["group_name"],
                master_address=group["master_address"],
                master_port=group["master_port"],
                rank_offset=group["rank_offset"],
                world_size=group["world_size"],
            )
        )
    if open_update is not None:
        info.open_weight_update.CopyFrom(
            cp.OpenWeightUpdate(
                owner=open_update.owner,
                age_seconds=open_update.age_seconds,
                idle_seconds=open_update.idle_seconds,
                lease_seconds=round(open_update.lease_seconds),
                weight_version=open_update.target_version,
                parameters_staged=open_update.parameters_staged,
                bytes_received=open_update.bytes_received,
            )
        )
    if server.rollback_version is not None:
        info.rollback_weight_version = server.rollback_version
    return info
