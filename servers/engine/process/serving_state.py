"""Whether a server may take calls: starting, serving or draining, and its parts once ready."""

from __future__ import annotations

from typing import Generic, TypeVar

from skyrl_grpc.errors import Unavailable

PartsT = TypeVar("PartsT")


class ServingState(Generic[PartsT]):
    """Holds the engine's parts once ready; handlers ask for them and get UNAVAILABLE otherwise."""

    def __init__(self) -> None:
        self.started: PartsT | None = None  # the parts once the engine is up, whatever the state
        # Whether calls may use them: not while the server warms up and catches up with its
        # peers (a pause or an update from outside then would stall its own start).
        self.serving = False
        self.draining = False
        self.dead: str | None = None  # why the engine died, once it has

    def set_ready(self, parts: PartsT) -> None:
        """The engine is up (a drain shuts it down from now on); calls still wait."""
        self.started = parts

    def set_serving(self) -> None:
        """Warmed up and caught up: calls may use the parts."""
        self.serving = True

    def parts(self) -> PartsT:
        if self.dead is not None:
            raise Unavailable(f"{self.dead}; this server is shutting down: send to another server")
        if self.draining:
            raise Unavailable("the server is draining (shutting down): send to another server")
        if self.started is None or not self.serving:
            raise Unavailable("the engine is still starting: retry when health reports SERVING")
        return self.started
