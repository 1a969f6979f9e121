"""vLLM's own gRPC contract on this server: the ``vllm.Inference`` and ``vllm.Control`` services
of vLLM's Rust front end (``rust/proto/*.proto`` in vLLM's release, generated into
``skyrl_grpc.vllm_api``), beside this stack's and beside ``vllm.grpc.engine.VllmEngine``
(``service.vllm_protocol``).

Each call is mapped onto this server's own: a vLLM request is converted into the DataPlane's or
the ControlPlane's request (``vllm_inference_convert``, ``vllm_control_convert``) and served by
the same servicer, so the checks, pause modes, admission, weight versions, LoRA adapters,
metrics and errors are those of this stack. Generation runs as the DataPlane's GenerateStream
(n samples too, which vLLM's own front end refuses); weight updates open, receive and commit
this server's transaction (the JSON of vLLM's NCCL engine read as this stack's collective
buckets; in-band pushes by PushWeights into the same update); versions are this server's
numbers, written as text. What has no mapping is refused UNIMPLEMENTED with the call to use instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc

from servers.common.grpc_types import Context
from servers.engine.service import vllm_control_convert as control_convert
from servers.engine.service import vllm_inference_convert as inference_convert
from servers.engine.service.control_plane import ControlPlaneParts, ControlPlaneServicer
from servers.engine.service.data_plane import DataPlaneParts, DataPlaneServicer
from servers.engine.vllm_adapter.scheduling import scheduling_limits
from skyrl_grpc.errors import InvalidArgument, Unimplemented
from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import data_plane_pb2 as dp
from skyrl_grpc.vllm_api import control_pb2 as vc
from skyrl_grpc.vllm_api import control_pb2_grpc, inference_pb2_grpc
from skyrl_grpc.vllm_api import inference_pb2 as vi

INFERENCE, CONTROL = inference_convert.INFERENCE, control_convert.CONTROL


class VllmInference(inference_pb2_grpc.InferenceServicer):
    """``vllm.Inference``: Generate and GenerateStream as the DataPlane's GenerateStream."""

    def __init__(self, data_plane: DataPlaneServicer, parts: Callable[[], DataPlaneParts]):
        self._data_plane = data_plane
        self._parts = parts

    async def _prompt(self, request: vi.GenerateRequest, context: Context) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            tokens = await self._data_plane.Tokenize(dp.TokenizeRequest(text=request.text), context)
            return list(tokens.token_ids)
        raise InvalidArgument("prompt is required: set text or token_ids")

    async def GenerateStream(
        self, request: vi.GenerateRequest, context: Context
    ) -> AsyncIterator[vi.GenerateResponse]:
        prompt = await self._prompt(request, context)
        model = self._parts().describe_model()
        shape = inference_convert.ResponseShape.of(request)
        ours = inference_convert.generate_stream_request(
            request, prompt, model.served_model_name, shape
        )
        stop_ids = ours.sampling_params.stop_token_ids
        outputs = inference_convert.SequenceOutputs(shape, stop_ids, model.eos_token_ids)
        first = True
        async for message in self._data_plane.GenerateStream(ours, context):
            if first:  # as vLLM's front end: the prompt's facts first, on their own
                info = inference_convert.prompt_info(list(ours.prompt_token_ids), message, shape)
                yield vi.GenerateResponse(prompt_info=info)
                first = False
            yield vi.GenerateResponse(outputs=outputs.convert(message))

    async def Generate(self, request: vi.GenerateRequest, context: Context) -> vi.GenerateResponse:
        if request.sampling.num_sequences > 1:
            raise InvalidArgument(
                "sampling.num_sequences > 1: Generate answers with one sequence; use "
                "GenerateStream, whose outputs carry each sample's index"
            )
        info = vi.PromptInfo()
        outputs = []
        async for response in self.GenerateStream(request, context):
            if response.HasField("prompt_info"):
                info = response.prompt_info
            else:
                outputs.append(response.outputs)
        return vi.GenerateResponse(prompt_info=info, outputs=inference_convert.joined(outputs))


@dataclass(frozen=True)
class ServerIdentity:
    """What vLLM's GetServerInfo and GetModelInfo say beside the engine's facts."""

    instance_id: str  # the server's address
    tool_call_parser: str = ""
    reasoning_parser: str = ""


class VllmControl(control_pb2_grpc.ControlServicer):
    """``vllm.Control``: each call as the ControlPlane's (or the DataPlane's Abort)."""

    def __init__(
        self,
        control_plane: ControlPlaneServicer,
        data_plane: DataPlaneServicer,
        parts: Callable[[], tuple[ControlPlaneParts, DataPlaneParts]],
        identity: ServerIdentity,
        shutdown: Callable[[], None],
    ) -> None:
        self._control = control_plane
        self._data = data_plane
        self._parts = parts
        self._identity = identity
        self._shutdown = shutdown
        # How the trainer of the last InitWeightTransferEngine lays out its broadcasts.
        self._packing = control_convert.Packing()

    async def GetServerInfo(
        self, request: vc.GetServerInfoRequest, context: Context
    ) -> vc.ServerInfo:
        control, data = self._parts()
        return control_convert.server_info(
            control.describe_server(),
            data.describe_model(),
            self._identity.instance_id,
            scheduling_limits(control.engine.llm),
        )

    async def GetModelInfo(self, request: vc.GetModelInfoRequest, context: Context) -> vc.ModelInfo:
        control, data = self._parts()
        identity = self._identity
        return control_convert.model_info(
            data.describe_model(),
            control.describe_server(),
            identity.tool_call_parser,
            identity.reasoning_parser,
        )

    async def Shutdown(self, request: vc.ShutdownRequest, context: Context) -> vc.ShutdownResponse:
        # Drains as SIGTERM does (in-flight calls get the drain grace), once this call has
        # ended: a drain begun before its answer left could stop the server first (the caller
        # then read UNAVAILABLE "Cancelling all calls", seen once in ~50 suite runs).
        def ended(_: Context) -> None:
            self._shutdown()

        # grpc-stubs type the callback as a class no function matches.
        context.add_done_callback(cast(Any, ended))
        return vc.ShutdownResponse()

    async def Abort(self, request: vc.AbortRequest, context: Context) -> vc.AbortResponse:
        await self._data.Abort(dp.AbortRequest(request_ids=request.request_ids), context)
        return vc.AbortResponse()

    async def LoadLora(self, request: vc.LoadLoraRequest, context: Context) -> vc.LoadLoraResponse:
        if not request.lora_name or not request.source_path:
            raise InvalidArgument(
                "lora_name and source_path (a directory on the server) are required"
            )
        spec = cp.LoraAdapterSpec(name=request.lora_name, path=request.source_path)

        async def one_message() -> AsyncIterator[cp.LoadLoraAdapterRequest]:
            yield cp.LoadLoraAdapterRequest(spec=spec)

        loaded = await self._control.LoadLoraAdapter(one_message(), context)
        adapter = control_convert.lora_adapter(loaded.adapter, request.source_path)
        return vc.LoadLoraResponse(adapter=adapter)

    async def UnloadLora(
        self, request: vc.UnloadLoraRequest, context: Context
    ) -> vc.UnloadLoraResponse:
        if not request.lora_name.strip():
            raise InvalidArgument("lora_name is required")
        unloaded = await self._control.UnloadLoraAdapter(
            cp.UnloadLoraAdapterRequest(name=request.lora_name), context
        )  # NOT_FOUND, naming the adapters there are, when it is not loaded
        adapter = vc.LoraAdapter(lora_id=unloaded.version, lora_name=request.lora_name)
        return vc.UnloadLoraResponse(adapter=adapter)

    async def ListLoras(
        self, request: vc.ListLorasRequest, context: Context
    ) -> vc.ListLorasResponse:
        listed = await self._control.ListLoraAdapters(cp.ListLoraAdaptersRequest(), context)
        adapters = sorted(listed.adapters, key=lambda adapter: adapter.name)
        return vc.ListLorasResponse(adapters=[control_convert.lora_adapter(a) for a in adapters])

    async def GetKvEventSources(
        self, request: vc.GetKvEventSourcesRequest, context: Context
    ) -> vc.GetKvEventSourcesResponse:
        # This server publishes no KV-cache events (vLLM's --kv-events-config is not set).
        return vc.GetKvEventSourcesResponse()

    async def PauseGeneration(
        self, request: vc.PauseGenerationRequest, context: Context
    ) -> vc.PauseGenerationResponse:
        clear = request.clear_cache if request.HasField("clear_cache") else None
        await self._control.Pause(control_convert.pause_request(request.mode, clear), context)
        return vc.PauseGenerationResponse()

    async def ResumeGeneration(
        self, request: vc.ResumeGenerationRequest, context: Context
    ) -> vc.ResumeGenerationResponse:
        await self._control.Resume(cp.ResumeRequest(), context)
        return vc.ResumeGenerationResponse()

    async def IsPaused(self, request: vc.IsPausedRequest, context: Context) -> vc.IsPausedResponse:
        paused = await self._control.IsPaused(cp.IsPausedRequest(), context)
        return vc.IsPausedResponse(paused=paused.paused)

    async def Sleep(self, request: vc.SleepRequest, context: Context) -> vc.SleepResponse:
        level = request.level if request.HasField("level") else 1
        control, _ = self._parts()
        if control.describe_server().sleep_supported and request.mode:
            await self._control.Pause(control_convert.pause_request(request.mode, None), context)
        # FAILED_PRECONDITION, saying why, where the engine cannot sleep (a CPU engine).
        await self._control.Sleep(cp.SleepRequest(level=level), context)
        return vc.SleepResponse()

    async def WakeUp(self, request: vc.WakeUpRequest, context: Context) -> vc.WakeUpResponse:
        await self._control.WakeUp(cp.WakeUpRequest(tags=request.tags), context)
        return vc.WakeUpResponse()

    async def IsSleeping(
        self, request: vc.IsSleepingRequest, context: Context
    ) -> vc.IsSleepingResponse:
        sleeping = await self._control.IsSleeping(cp.IsSleepingRequest(), context)
        return vc.IsSleepingResponse(sleeping=sleeping.sleeping)

    async def InitWeightTransferEngine(
        self, request: vc.InitWeightTransferEngineRequest, context: Context
    ) -> vc.InitWeightTransferEngineResponse:
        control, _ = self._parts()
        backend = control_convert.transfer_backend(control.describe_server())
        ours, packing = control_convert.init_weight_transfer(request.init_info_json, backend)
        await self._control.InitWeightTransfer(ours, context)
        self._packing = packing
        return vc.InitWeightTransferEngineResponse()

    async def StartWeightUpdate(
        self, request: vc.StartWeightUpdateRequest, context: Context
    ) -> vc.StartWeightUpdateResponse:
        owner = f"vllm.Control client {context.peer()}"
        await self._control.StartWeightUpdate(cp.StartWeightUpdateRequest(owner=owner), context)
        return vc.StartWeightUpdateResponse()

    async def StartDraftWeightUpdate(
        self, request: vc.StartDraftWeightUpdateRequest, context: Context
    ) -> vc.StartDraftWeightUpdateResponse:
        raise Unimplemented(
            "StartDraftWeightUpdate: this server runs no speculative draft model; update the "
            "served model with StartWeightUpdate"
        )

    async def UpdateWeights(
        self, request: vc.UpdateWeightsRequest, context: Context
    ) -> vc.UpdateWeightsResponse:
        buckets = control_convert.update_weights(request.update_info_json, self._packing)
        await self._control.UpdateWeights(buckets, context)
        return vc.UpdateWeightsResponse()

    async def FinishWeightUpdate(
        self, request: vc.FinishWeightUpdateRequest, context: Context
    ) -> vc.FinishWeightUpdateResponse:
        if request.HasField("weight_version"):
            version = control_convert.weight_version(request.weight_version, "weight_version")
        else:  # every update gets its own number here: the next one
            control, _ = self._parts()
            version = control.weights.version + 1
        await self._control.FinishWeightUpdate(
            cp.FinishWeightUpdateRequest(weight_version=version), context
        )
        return vc.FinishWeightUpdateResponse()

    async def UpdateWeightVersion(
        self, request: vc.UpdateWeightVersionRequest, context: Context
    ) -> vc.UpdateWeightVersionResponse:
        raise Unimplemented(
            "UpdateWeightVersion: this server stamps a version only on the weights that bring "
            "it; name it in FinishWeightUpdate(weight_version=...) of the update instead"
        )

    async def GetWeightVersion(
        self, request: vc.GetWeightVersionRequest, context: Context
    ) -> vc.GetWeightVersionResponse:
        control, _ = self._parts()
        return vc.GetWeightVersionResponse(weight_version=str(control.weights.version))


def add_vllm_api(
    server: grpc.aio.Server,
    data_plane: DataPlaneServicer,
    control_plane: ControlPlaneServicer,
    parts: Callable[[], tuple[ControlPlaneParts, DataPlaneParts]],
    identity: ServerIdentity,
    shutdown: Callable[[], None],
) -> None:
    """Serves ``vllm.Inference`` and ``vllm.Control`` on ``server``."""
    inference = VllmInference(data_plane, lambda: parts()[1])
    inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
    control = VllmControl(control_plane, data_plane, parts, identity, shutdown)
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
