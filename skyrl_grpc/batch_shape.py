"""The shape of a GenerateBatch: one rule for the engine server and for the router that splits
a batch by placement, so both refuse the same malformed batch with the same words; and, for a
GenerateMultiplex call, the indices a request added may not take."""

from __future__ import annotations

from collections.abc import Container, Iterable

from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import data_plane_pb2


def batch_shape(request: data_plane_pb2.GenerateBatchRequest) -> tuple[list[int], list[str]]:
    """Every request's index and session ("" for none): at least one request, and
    ``indices`` / ``session_ids`` each empty or one per request, the indices distinct."""
    count = len(request.requests)
    if not count:
        raise InvalidArgument("requests is empty: send at least one request")
    for name, values in (("indices", request.indices), ("session_ids", request.session_ids)):
        if values and len(values) != count:
            raise InvalidArgument(
                f"{name} has {len(values)} entries for {count} requests: give one per request, "
                "or none"
            )
    indices = list(request.indices) or list(range(count))
    if len(set(indices)) != count:
        raise InvalidArgument("indices repeat: each request needs an index of its own")
    return indices, list(request.session_ids) or [""] * count


def check_unused(indices: Iterable[int], in_use: Container[int]) -> None:
    """INVALID_ARGUMENT when one of ``indices`` (of requests added to a GenerateMultiplex call)
    names a request of the call still running (``in_use``): the caller's bookkeeping is wrong,
    and its reports would mix two requests."""
    if taken := sorted(i for i in set(indices) if i in in_use):
        raise InvalidArgument(
            f"indices {taken} are in use by running requests of this call; "
            "an index can be used again once its request has ended"
        )
