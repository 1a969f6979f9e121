"""ControlPlane servicer: pause/resume (the domain's ``Pausing``), sleep/wake, prefix cache,
weight updates (the serving weights' ``updates``, ``domain.weights.transaction``), LoRA
adapters (``lora_adapters.AdapterManager``), the reads a peer catching up makes (ReadWeights,
ReadLoraAdapter), server info and load. Converts with ``control_convert``; holds no logic.
Built with exactly the parts it uses (``ControlPlaneParts``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory

from servers.common.grpc_types import Context
from servers.engine.domain.descriptions import ServerDescription
from servers.engine.domain.lora_adapters import AdapterManager, AdapterUpload
from servers.engine.domain.pausing import Pausing
from servers.engine.domain.weights.serving import ServingWeights
from servers.engine.peers import stream_items
from servers.engine.service import control_convert, data_convert, validate
from servers.engine.service.weight_streams import WeightStreams, push_response
from servers.engine.vllm_adapter.vllm_engine import VllmEngine
from skyrl_grpc.chunk_wire import WireChunk, decode_push_request
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.names import CONTROL_PLANE, CONTROL_PLANE_SERVICE
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc

# Bytes of parameter data per ReadWeights chunk unless the caller asks otherwise: under the
# 4 MiB message limit of a default gRPC channel with room for the rest of the message.
READ_CHUNK_BYTES = 2 << 20


def add_control_plane(
    servicer: control_plane_pb2_grpc.ControlPlaneServicer, server: grpc.aio.Server
) -> None:
    """Registers the ControlPlane as the generated code does (a handler per method of the
    service's descriptor, its messages parsed and serialized by their classes), except that
    PushWeights reads its chunks with ``decode_push_request``: their data stays a view of the
    received bytes instead of being copied twice by protobuf (see ``skyrl_grpc.chunk_wire``),
    and the bytes themselves come along, for a relay to forward as they are."""
    handlers = {}
    for method in CONTROL_PLANE_SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        make = _HANDLERS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=(
                raw_and_decoded if method.name == "PushWeights" else request.FromString
            ),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(CONTROL_PLANE, handlers),)
    )
    server.add_registered_method_handlers(CONTROL_PLANE, handlers)


# grpc's handler for each kind of method: (client streams, server streams) -> its maker.
_HANDLERS: dict[tuple[bool, bool], Any] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def raw_and_decoded(raw: bytes) -> tuple[bytes, cp.PushWeightsRequest | WireChunk]:
    return raw, decode_push_request(raw)


@dataclass(frozen=True)
class ControlPlaneParts:
    """What the control plane serves with (built by ``process.engine_parts``)."""

    pausing: Pausing  # announces pauses and resumes itself
    engine: VllmEngine  # sleep, wake, the prefix cache, load
    weights: ServingWeights  # updates, and the serving weights a peer reads
    adapters: AdapterManager
    describe_server: Callable[[], ServerDescription]


class ControlPlaneServicer(control_plane_pb2_grpc.ControlPlaneServicer):
    """Serves control calls for one vLLM engine. ``parts`` gives the parts once the engine
    serves (UNAVAILABLE before); ``streams`` takes PushWeights' streams (as it takes the push
    socket's); ``push_socket_port``: offered with every update (0: none)."""

    def __init__(
        self,
        parts: Callable[[], ControlPlaneParts],
        streams: WeightStreams,
        push_socket_port: int = 0,
    ) -> None:
        self._parts = parts
        self._streams = streams
        self._push_socket_port = push_socket_port

    async def Pause(self, request: cp.PauseRequest, context: Context) -> cp.PauseResponse:
        mode = validate.pause_mode(request.mode)
        await self._parts().pausing.pause(mode, request.clear_cache)
        return cp.PauseResponse()

    async def Resume(self, request: cp.ResumeRequest, context: Context) -> cp.ResumeResponse:
        await self._parts().pausing.resume()
        return cp.ResumeResponse()

    async def IsPaused(self, request: cp.IsPausedRequest, context: Context) -> cp.IsPausedResponse:
        return cp.IsPausedResponse(paused=await self._parts().pausing.is_paused())

    async def Sleep(self, request: cp.SleepRequest, context: Context) -> cp.SleepResponse:
        await self._parts().engine.sleep(validate.sleep_level(request.level))
        return cp.SleepResponse()

    async def WakeUp(self, request: cp.WakeUpRequest, context: Context) -> cp.WakeUpResponse:
        await self._parts().engine.wake_up(list(request.tags) or None)
        return cp.WakeUpResponse()

    async def IsSleeping(
        self, request: cp.IsSleepingRequest, context: Context
    ) -> cp.IsSleepingResponse:
        return cp.IsSleepingResponse(sleeping=await self._parts().engine.is_sleeping())

    async def ResetPrefixCache(
        self, request: cp.ResetPrefixCacheRequest, context: Context
    ) -> cp.ResetPrefixCacheResponse:
        await self._parts().engine.reset_prefix_cache()
        return cp.ResetPrefixCacheResponse()

    async def InitWeightTransfer(
        self, request: cp.InitWeightTransferRequest, context: Context
    ) -> cp.InitWeightTransferResponse:
        group = validate.weight_transfer_group(request)
        await self._parts().weights.updates.init(group)
        return cp.InitWeightTransferResponse()

    async def StartWeightUpdate(
        self, request: cp.StartWeightUpdateRequest, context: Context
    ) -> cp.StartWeightUpdateResponse:
        parts = self._parts()
        update = await parts.weights.updates.start(
            request.weight_version,
            allow_same_version=request.allow_same_version,
            owner=request.owner,
            lease_seconds=request.lease_seconds,
            ticket=request.push_ticket,
            relay=control_convert.relay_role(request),
        )
        return cp.StartWeightUpdateResponse(
            serving_weight_version=parts.weights.version,
            lease_seconds=round(update.lease_seconds),
            push_socket_port=self._push_socket_port,
            push_ticket=update.ticket if self._push_socket_port else b"",
        )

    async def UpdateWeights(
        self, request: cp.UpdateWeightsRequest, context: Context
    ) -> cp.UpdateWeightsResponse:
        buckets = control_convert.bucket_specs(request)
        staged, received = await self._parts().weights.updates.update(buckets)
        return cp.UpdateWeightsResponse(parameters_staged=staged, bytes_received=received)

    # Its messages come as ``add_control_plane``'s deserializer makes them, not as generated.
    async def PushWeights(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[tuple[bytes, cp.PushWeightsRequest | WireChunk]],
        context: Context,
    ) -> cp.PushWeightsResponse:
        # Refused mid-stream, the rest of the stream is read before the status is sent: the
        # error interceptor does that for every client-streaming call.
        ticket, relayed_from, tree = control_convert.stream_sender(context.invocation_metadata())
        outcome, address = await self._streams.stage(
            ticket, relayed_from, tree, control_convert.push_messages(request_iterator)
        )
        return push_response(outcome, address, context)

    async def FinishWeightUpdate(
        self, request: cp.FinishWeightUpdateRequest, context: Context
    ) -> cp.FinishWeightUpdateResponse:
        version, count = await self._parts().weights.updates.finish(request.weight_version)
        return cp.FinishWeightUpdateResponse(weight_version=version, parameters_updated=count)

    async def CancelWeightUpdate(
        self, request: cp.CancelWeightUpdateRequest, context: Context
    ) -> cp.CancelWeightUpdateResponse:
        discarded = await self._parts().weights.updates.cancel()
        return cp.CancelWeightUpdateResponse(parameters_discarded=discarded)

    async def RollbackWeightUpdate(
        self, request: cp.RollbackWeightUpdateRequest, context: Context
    ) -> cp.RollbackWeightUpdateResponse:
        version = await self._parts().weights.updates.rollback(request.weight_version)
        return cp.RollbackWeightUpdateResponse(weight_version=version)

    async def ReleaseRollback(
        self, request: cp.ReleaseRollbackRequest, context: Context
    ) -> cp.ReleaseRollbackResponse:
        freed = await self._parts().weights.updates.release_rollback(request.weight_version)
        return cp.ReleaseRollbackResponse(released_bytes=freed)

    async def GetWeightChecksums(
        self, request: cp.GetWeightChecksumsRequest, context: Context
    ) -> cp.GetWeightChecksumsResponse:
        parts = self._parts()
        checksums = await parts.weights.updates.checksums(list(request.names))
        return cp.GetWeightChecksumsResponse(
            checksums=[control_convert.checksum_to_proto(row) for row in checksums],
            weight_version=parts.weights.version,
        )

    async def ReadWeights(
        self, request: cp.ReadWeightsRequest, context: Context
    ) -> AsyncIterator[cp.ReadWeightsResponse]:
        weights = self._parts().weights
        chunk_bytes = request.chunk_bytes or READ_CHUNK_BYTES
        version, parameters = await weights.readable()
        yield control_convert.read_manifest(version, parameters)
        names = [name for name, _, _ in parameters]
        async for name, data in weights.read(version, names):
            for message in control_convert.read_chunks(version, name, data, chunk_bytes):
                yield message

    async def LoadLoraAdapter(
        self, request_iterator: AsyncIterator[cp.LoadLoraAdapterRequest], context: Context
    ) -> cp.LoadLoraAdapterResponse:
        parts = self._parts()
        upload: AdapterUpload | None = None
        async for message in request_iterator:
            if upload is None:
                upload = parts.adapters.upload(stream_items.adapter_spec(message))
            else:
                upload.add(stream_items.adapter_item(message))
        if upload is None:
            raise InvalidArgument("the LoadLoraAdapter stream was empty: send the spec first")
        adapter, replaced = await parts.adapters.load(upload)
        return cp.LoadLoraAdapterResponse(
            adapter=data_convert.lora_adapter_to_proto(adapter), replaced_version=replaced
        )

    async def UnloadLoraAdapter(
        self, request: cp.UnloadLoraAdapterRequest, context: Context
    ) -> cp.UnloadLoraAdapterResponse:
        adapter = await self._parts().adapters.unload(request.name)
        return cp.UnloadLoraAdapterResponse(version=adapter.version)

    async def ListLoraAdapters(
        self, request: cp.ListLoraAdaptersRequest, context: Context
    ) -> cp.ListLoraAdaptersResponse:
        adapters = self._parts().adapters.serving()
        return cp.ListLoraAdaptersResponse(
            adapters=[data_convert.lora_adapter_to_proto(a) for a in adapters]
        )

    async def ReadLoraAdapter(
        self, request: cp.ReadLoraAdapterRequest, context: Context
    ) -> AsyncIterator[cp.ReadLoraAdapterResponse]:
        copy = await self._parts().adapters.read(request.name)
        for message in control_convert.adapter_read(copy, request.chunk_bytes or READ_CHUNK_BYTES):
            yield message

    async def GetServerInfo(
        self, request: cp.GetServerInfoRequest, context: Context
    ) -> cp.GetServerInfoResponse:
        info = control_convert.server_info_to_proto(self._parts().describe_server())
        info.push_socket_port = self._push_socket_port
        return info

    async def GetLoad(self, request: cp.GetLoadRequest, context: Context) -> cp.GetLoadResponse:
        parts = self._parts()
        load = parts.engine.load()
        return cp.GetLoadResponse(
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            paused=await parts.pausing.is_paused(),
        )
