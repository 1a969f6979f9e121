"""Full names of the contract's services and methods, read from the generated descriptors.

Every process refers to services and methods through these constants, so a rename in
``protos/`` is a one-line regeneration, never a hunt for string literals.
"""

from __future__ import annotations

from google.protobuf.descriptor import ServiceDescriptor

from skyrl_grpc.v1 import control_plane_pb2, data_plane_pb2, router_pb2, status_pb2

DATA_PLANE_SERVICE: ServiceDescriptor = data_plane_pb2.DESCRIPTOR.services_by_name["DataPlane"]
CONTROL_PLANE_SERVICE: ServiceDescriptor = control_plane_pb2.DESCRIPTOR.services_by_name[
    "ControlPlane"
]
ROUTER_ADMIN_SERVICE: ServiceDescriptor = router_pb2.DESCRIPTOR.services_by_name["RouterAdmin"]
SERVER_STATUS_SERVICE: ServiceDescriptor = status_pb2.DESCRIPTOR.services_by_name["ServerStatus"]

DATA_PLANE: str = DATA_PLANE_SERVICE.full_name
CONTROL_PLANE: str = CONTROL_PLANE_SERVICE.full_name
ROUTER_ADMIN: str = ROUTER_ADMIN_SERVICE.full_name
SERVER_STATUS: str = SERVER_STATUS_SERVICE.full_name


def method_path(service: ServiceDescriptor, method: str) -> str:
    """The path a call names on the wire, ``/package.Service/Method``; raises KeyError for a
    method the service does not have."""
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


GENERATE_STREAM = method_path(DATA_PLANE_SERVICE, "GenerateStream")
GENERATE_BATCH = method_path(DATA_PLANE_SERVICE, "GenerateBatch")
GENERATE_MULTIPLEX = method_path(DATA_PLANE_SERVICE, "GenerateMultiplex")
ABORT = method_path(DATA_PLANE_SERVICE, "Abort")
FINISH_SESSION = method_path(DATA_PLANE_SERVICE, "FinishSession")
PUSH_WEIGHTS = method_path(CONTROL_PLANE_SERVICE, "PushWeights")
TOKENIZE = method_path(DATA_PLANE_SERVICE, "Tokenize")
DETOKENIZE = method_path(DATA_PLANE_SERVICE, "Detokenize")
GET_MODEL_INFO = method_path(DATA_PLANE_SERVICE, "GetModelInfo")
GET_TOKENIZER = method_path(DATA_PLANE_SERVICE, "GetTokenizer")
WATCH_BACKENDS = method_path(ROUTER_ADMIN_SERVICE, "WatchBackends")
