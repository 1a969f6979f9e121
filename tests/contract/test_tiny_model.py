"""The embedded model's builder is deterministic and its cache is keyed by the recipe."""

from __future__ import annotations

from pathlib import Path

from skyrl_grpc.tiny_model import TinyModelSpec, build_tiny_model, ensure_tiny_model


def test_two_builds_are_byte_identical(tmp_path: Path, tiny_model_dir: Path) -> None:
    # The session's cached build (another process, maybe another day) against a fresh one: a
    # builder change that alters the output must also change the cache key (RECIPE_VERSION).
    first = tiny_model_dir
    second = build_tiny_model(tmp_path / "second")
    names = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), (
            f"{name} differs from the cached build (a builder change needs a new RECIPE_VERSION)"
        )


def test_cache_reuses_a_build_and_separates_recipes(tmp_path: Path) -> None:
    cached = ensure_tiny_model(tmp_path)
    assert ensure_tiny_model(tmp_path) == cached
    other = ensure_tiny_model(tmp_path, TinyModelSpec(seed=1))
    assert other != cached
    assert (other / "model.safetensors").read_bytes() != (cached / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (cached / "tokenizer.json").read_bytes()
