"""Whether a server may take calls: starting, serving or draining, and the engine once ready."""

from __future__ import annotations

from typing import Generic, TypeVar

from skyrl_grpc.errors import Unavailable

EngineT = TypeVar("EngineT")


class ServingState(Generic[EngineT]):
    """Holds the engine once it is ready; handlers ask for it and get UNAVAILABLE otherwise."""

    def __init__(self) -> None:
        self.started: EngineT | None = None  # the engine once it is up, whatever the state
        self.draining = False
        self.dead: str | None = None  # why the engine died, once it has

    def set_ready(self, engine: EngineT) -> None:
        self.started = engine

    def engine(self) -> EngineT:
        if self.dead is not None:
            raise Unavailable(f"{self.dead}; this server is shutting down: send to another server")
        if self.draining:
            raise Unavailable("the server is draining (shutting down): send to another server")
        if self.started is None:
            raise Unavailable("the engine is still starting: retry when health reports SERVING")
        return self.started
