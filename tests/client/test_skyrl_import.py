"""SkyRL 0.4.0 imports in any order beside the drop-in, each order in a fresh interpreter, and
the drop-in leaves the standard library alone: a user's own pydantic model on
``typing.TypedDict`` behaves as it would without this project (pydantic refuses it before
Python 3.12)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

# Each test starts fresh interpreters that import SkyRL (seconds each): not in the quick loop.
pytestmark = [pytest.mark.slow]

SKYRL_FIRST = """
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from trainer_client.skyrl_engine import SkyRLInferenceEngine
    assert issubclass(SkyRLInferenceEngine, InferenceEngineInterface)
"""
DROP_IN_FIRST = """
    from trainer_client.skyrl_engine import SkyRLInferenceEngine
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    assert issubclass(SkyRLInferenceEngine, InferenceEngineInterface)
"""
# What SkyRL's own entry point imports before a get_inference_client() override.
ENTRY_POINT_FIRST = """
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from trainer_client.skyrl_engine import SkyRLInferenceEngine
"""
USERS_OWN_MODEL = """
    import typing, typing_extensions
    import trainer_client.skyrl_engine
    import skyrl.train.generators.base
    assert typing.TypedDict is not typing_extensions.TypedDict, "typing.TypedDict was rebound"

    import pydantic

    class Point(typing.TypedDict):
        x: int

    try:
        pydantic.TypeAdapter(Point)
    except pydantic.PydanticUserError as error:
        assert "typing_extensions.TypedDict" in str(error)
        print("refused, as without skyrl-grpc")
    else:
        print("accepted")
"""


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "order",
    [SKYRL_FIRST, DROP_IN_FIRST, ENTRY_POINT_FIRST],
    ids=["skyrl first", "drop-in first", "skyrl's entry point first"],
)
def test_skyrl_and_the_drop_in_import_in_any_order(order: str) -> None:
    result = run_fresh(order)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_users_typeddict_behaves_as_without_this_project() -> None:
    result = run_fresh(USERS_OWN_MODEL)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "accepted" if sys.version_info >= (3, 12) else "refused, as without skyrl-grpc"
    assert result.stdout.strip() == expected
