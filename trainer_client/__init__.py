"""What an RL trainer imports: a serializable client for a skyrl-grpc fleet.

    from trainer_client import InferenceClient, BlockingInferenceClient

Data-plane calls go to the server the router's policy picks; control calls fan out to every
server. Results are plain dataclasses; errors are ``InferenceError`` subclasses.
``FleetAdminClient`` grows or shrinks a running fleet (``skyrl-grpc up --admin-port``).
"""

from skyrl_grpc.fleet_admin import FleetAdminClient, FleetAdminError, FleetMembers
from trainer_client.blocking import BlockingInferenceClient
from trainer_client.client import InferenceClient
from trainer_client.config import DEFAULT, ClientConfig, ClientSettings, Timeout, TlsConfig
from trainer_client.exceptions import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FanOutError,
    InferenceError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
    Unauthenticated,
    Unavailable,
    Unsupported,
)
from trainer_client.fleet_info import (
    Capabilities,
    LoraAdapter,
    LoraCapabilities,
    ModelInfo,
    OpenWeightUpdate,
    PauseMode,
    ServerInfo,
    ServerLoad,
    WeightCommit,
    WeightUpdateResult,
)
from trainer_client.results import FinishReason, GenerationResult, WeightSpan, WeightVersions
from trainer_client.sampling import sampling_params
from trainer_client.tool_use import AssistantMessage, CallFunction, Tool, ToolCall, ToolChoice
from trainer_client.weights.weight_transaction import WeightUpdateError

__all__ = [
    "DEFAULT",
    "Aborted",
    "AlreadyExists",
    "AssistantMessage",
    "BlockingInferenceClient",
    "CallFunction",
    "Cancelled",
    "Capabilities",
    "ClientConfig",
    "ClientSettings",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FanOutError",
    "FinishReason",
    "FleetAdminClient",
    "FleetAdminError",
    "FleetMembers",
    "GenerationResult",
    "InferenceClient",
    "InferenceError",
    "Internal",
    "InvalidArgument",
    "LoraAdapter",
    "LoraCapabilities",
    "ModelInfo",
    "NotFound",
    "OpenWeightUpdate",
    "PauseMode",
    "PermissionDenied",
    "ResourceExhausted",
    "ServerError",
    "ServerInfo",
    "ServerLoad",
    "Timeout",
    "TlsConfig",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "Unauthenticated",
    "Unavailable",
    "Unsupported",
    "WeightCommit",
    "WeightSpan",
    "WeightUpdateError",
    "WeightUpdateResult",
    "WeightVersions",
    "sampling_params",
]
