"""The RL demo: the reward rises only when new weights reach the servers; the CLI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from trainer_client import InferenceClient
from trainer_client.demo import TARGET_STRIDE, DemoConfig, run_rl_loop

pytestmark = [pytest.mark.engine]
ROOT = Path(__file__).resolve().parents[2]


async def test_reward_rises_with_weight_sync_and_stays_flat_without(
    two_server_router: Any, engine_server: Any, second_engine_server: Any, tiny_model_dir: Path
) -> None:
    client = InferenceClient(
        two_server_router.address, [engine_server.address, second_engine_server.address]
    )
    original = load_file(str(tiny_model_dir / "model.safetensors"))

    async def restore() -> None:
        version = max((await client.weight_versions()).values()) + 1
        await client.update_weights(original.items(), version, transport="grpc")

    await restore()
    # 12 steps: with 8, whether the reward is past +0.2 yet depends on the engine's sampling
    # stream (what ran on it before this test).
    short = dict(steps=12, batch_size=16, max_tokens=16, seed=0, progress=False)
    learned = await run_rl_loop(client, tiny_model_dir, DemoConfig(**short, sync=True))  # type: ignore[arg-type]
    await restore()
    control = await run_rl_loop(client, tiny_model_dir, DemoConfig(**short, sync=False))  # type: ignore[arg-type]
    print("with sync:", [round(r, 3) for r in learned.rewards])
    print("without sync:", [round(r, 3) for r in control.rewards])
    first, last = learned.summary()
    assert last > first + 0.2, learned.rewards
    control_first, control_last = control.summary()
    chance = 1 / TARGET_STRIDE
    assert abs(control_last - control_first) < 0.05 and control_last < chance + 0.05, (
        control.rewards
    )
    assert all(s > 0 for s in learned.sync_seconds) and not any(control.sync_seconds)
    await restore()


def test_cli_demo_runs_end_to_end(tmp_path: Path) -> None:
    """The README's first command, shortened: starts its own stack, trains, writes the PNG."""
    output = tmp_path / "reward.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "servers.cli",
            "demo",
            "--steps",
            "3",
            "--max-tokens",
            "16",
            "--output",
            str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "reward curve written to" in result.stdout
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
