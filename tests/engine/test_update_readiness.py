"""When a server prepares for its first weight update (``--weight-staging``): at start, beside
the first generation, or never ahead; never twice, and never beside an open update."""

from __future__ import annotations

import asyncio

import pytest

from servers.engine.domain.weights.readiness import UpdateReadiness
from servers.engine.options import (
    STAGING_CHOICES,
    EngineOptions,
    build_parser,
    engine_options_from_args,
)


class Preparation:
    """A stand-in ``prepare`` that records its calls and ends when the test lets it."""

    def __init__(self, fails: bool = False) -> None:
        self.calls = 0
        self.may_end = asyncio.Event()
        self.fails = fails

    async def __call__(self) -> None:
        self.calls += 1
        await self.may_end.wait()
        if self.fails:
            raise RuntimeError("cannot reload")


async def test_at_first_generation_it_prepares_once_beside_it_and_an_update_waits_for_it() -> None:
    preparation = Preparation()
    readiness = UpdateReadiness(preparation, "first-generation")
    await readiness.at_start()
    assert preparation.calls == 0  # an idle server holds nothing for updates
    readiness.on_generation()
    readiness.on_generation()
    await asyncio.sleep(0)
    assert preparation.calls == 1
    update = asyncio.ensure_future(readiness.before_update())
    await asyncio.sleep(0.05)
    assert not update.done()  # the update opens only once the preparation ended
    preparation.may_end.set()
    await update
    assert readiness.prepared and preparation.calls == 1
    await readiness.before_update()
    assert preparation.calls == 1


async def test_an_update_before_any_generation_prepares_first() -> None:
    preparation = Preparation()
    preparation.may_end.set()
    readiness = UpdateReadiness(preparation, "first-generation")
    await readiness.before_update()
    assert preparation.calls == 1
    readiness.on_generation()
    assert preparation.calls == 1


async def test_at_start_prepares_there_and_a_failure_fails_the_start() -> None:
    preparation = Preparation(fails=True)
    preparation.may_end.set()
    readiness = UpdateReadiness(preparation, "start")
    with pytest.raises(RuntimeError, match="cannot reload"):
        await readiness.at_start()
    assert preparation.calls == 1


async def test_a_failure_beside_a_generation_is_logged_and_the_update_goes_on() -> None:
    preparation = Preparation(fails=True)
    preparation.may_end.set()
    readiness = UpdateReadiness(preparation, "first-generation")
    readiness.on_generation()
    await readiness.before_update()  # does not raise: the update meets the failure itself
    assert preparation.calls == 1


async def test_first_update_never_prepares_ahead() -> None:
    preparation = Preparation()
    readiness = UpdateReadiness(preparation, "first-update")
    await readiness.at_start()
    readiness.on_generation()
    await readiness.before_update()
    assert preparation.calls == 0


def test_the_flag_takes_each_choice_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert EngineOptions().weight_staging == "first-generation"
    for choice in STAGING_CHOICES:
        args = build_parser().parse_args(["--weight-staging", choice])
        assert engine_options_from_args(args).weight_staging == choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weight-staging", "later"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one of"):
        UpdateReadiness(Preparation(), "later")
