"""When a server's calls may use its engine: not before it is up, not while it warms up and
catches up with its peers, not once it drains or its engine died (pure: no engine)."""

from __future__ import annotations

import pytest

from servers.engine.process.serving_state import ServingState
from skyrl_grpc.errors import Unavailable


def test_calls_wait_until_the_server_is_warm_and_caught_up() -> None:
    state: ServingState[str] = ServingState()
    with pytest.raises(Unavailable, match="still starting"):
        state.parts()
    state.set_ready("parts")  # up: a drain shuts it down, but a pause from outside must not
    assert state.started == "parts"  # stall its warm-up or its catch-up
    with pytest.raises(Unavailable, match="still starting"):
        state.parts()
    state.set_serving()
    assert state.parts() == "parts"
    state.draining = True
    with pytest.raises(Unavailable, match="draining"):
        state.parts()
