"""What an RL trainer imports: a serializable client for a skyrl-grpc fleet.

    from trainer_client import InferenceClient, BlockingInferenceClient

Data-plane calls go through the router; control calls fan out to every server.
"""

from .blocking import BlockingInferenceClient
from .client import InferenceClient, sampling_params
from .config import ClientConfig, TlsConfig
from .errors import FanOutError, InferenceError, ServerError
from .results import FinishReason, GenerationResult, WeightSpan, WeightVersions
from .weight_transaction import WeightUpdateError

__all__ = [
    "BlockingInferenceClient",
    "ClientConfig",
    "FanOutError",
    "FinishReason",
    "GenerationResult",
    "InferenceClient",
    "InferenceError",
    "ServerError",
    "TlsConfig",
    "WeightSpan",
    "WeightUpdateError",
    "WeightVersions",
    "sampling_params",
]
