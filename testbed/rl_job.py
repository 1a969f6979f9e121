"""The ``rl`` job (``python -m testbed.jobs rl ARGUMENTS``): a trainer's RL loop against the
fleet on its host, the demo's task and policy (``trainer_client.demo``), every step's weights
pushed to every server, for ``seconds``, as a trainer that meets faults runs it: a step whose
rollouts, pause, update or resume fail (a server cut off, killed or restarting) is tried again
every second, for ``retry_seconds`` at most, then the job gives up on it and goes on. Its
``client``: ``InferenceClient`` settings (``cut_out_unreachable``: steps go on without a server
the trainer cannot reach; past ``seconds``, the loop steps on until an update commits with
no server cut out, up to ``whole_seconds`` more, so a run ends with every server on its last
weights: a server taken back by a pause or a resume has none of the updates it missed until
the next update sends it the whole weights).

Its result: each step's mean reward and how long it took, and every update as a
``testbed.history.Update`` (committed, or not with the versions each server serves after it
and the servers it could not reach), what ``testbed.history.check`` reads.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

RETRY_EVERY_SECONDS = 1.0
BATCH = 8
MAX_TOKENS = 16
LEARNING_RATE = 1e-2


async def rl(arguments: dict[str, Any]) -> dict[str, Any]:
    from testbed.history import Update
    from testbed.job_io import client_settings
    from trainer_client import InferenceClient, InferenceError, WeightUpdateError
    from trainer_client.demo import Policy, reward

    client = InferenceClient(
        arguments["router"], arguments["servers"], **client_settings(arguments)
    )
    policy = Policy(Path(arguments["model"]), LEARNING_RATE, int(arguments.get("seed", 0)))
    rng = random.Random(int(arguments.get("seed", 0)))
    retry_seconds = float(arguments.get("retry_seconds", 120))
    sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    rewards: list[float] = []
    step_seconds: list[float] = []
    updates: list[Update] = []
    given_up: list[str] = []

    async def retried(what: str, call: Any) -> Any:
        """``call()`` until it succeeds, every second for ``retry_seconds``; None when it did
        not (recorded in ``given_up``)."""
        until = time.monotonic() + retry_seconds
        while True:
            try:
                return await call()
            except InferenceError as error:
                if time.monotonic() > until:
                    given_up.append(f"{what}: {error}"[:500])
                    return None
                await asyncio.sleep(RETRY_EVERY_SECONDS)

    try:
        deadline = time.monotonic() + float(arguments["seconds"])
        whole_by = deadline + float(arguments.get("whole_seconds", 120))
        step = 0
        left_out: list[str] = []  # the servers the last committed update left out
        while time.monotonic() < deadline or (
            (left_out or client.cut_out_servers) and time.monotonic() < whole_by
        ):
            began = time.monotonic()
            prompts = [[1, *(rng.randrange(3, 2048) for _ in range(4))] for _ in range(BATCH)]
            sessions = [f"rl{step}-{i}" for i in range(BATCH)]

            async def rollouts(
                prompts: list[list[int]] = prompts, sessions: list[str] = sessions
            ) -> Any:
                return await client.generate_batch(prompts, sampling, session_ids=sessions)

            results = await retried(f"step {step} rollouts", rollouts)
            if results is None:
                break
            rewards.append(sum(reward(r.token_ids) for r in results) / len(results))
            policy.step(results, baseline=rewards[-1])
            if await retried(f"step {step} pause", lambda: client.pause("abort")) is None:
                break

            async def push() -> Any:
                try:  # the version: one past the newest any server serves
                    result = await client.update_weights(policy.state_dict())
                except WeightUpdateError as failed:
                    versions = {
                        a: o.serving_version
                        for a, o in failed.outcomes.items()
                        if o.serving_version is not None
                    }
                    missing = [a for a, o in failed.outcomes.items() if o.serving_version is None]
                    updates.append(Update(failed.version, False, versions, missing))
                    raise
                after = {a: c.weight_version for a, c in result.items()}
                updates.append(Update(max(after.values()), True, after, list(result.cut_out)))
                left_out[:] = result.cut_out
                return result

            if await retried(f"step {step} update", push) is None:
                break
            if await retried(f"step {step} resume", client.resume) is None:
                break
            step_seconds.append(time.monotonic() - began)
            step += 1
        final = await retried("the versions at the end", client.weight_versions)
    finally:
        await client.close()
    return {
        "rewards": rewards,
        "step_seconds": step_seconds,
        "updates": [vars(u) for u in updates],
        "given_up": given_up,
        "left_out_at_the_end": {
            **dict.fromkeys(left_out, "the last update"),
            **client.cut_out_servers,
        },
        "versions": dict(final) if final is not None else {},
    }
