"""Talking to an OpenAI HTTP server (this stack's edge or vLLM's own) the way the tests compare
them: a whole answer, a stream's events, and the logit bias that lets a random model finish
JSON (a constraint allows any whitespace between tokens, and a random model writes little
else)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

Json = dict[str, Any]


async def whole(client: httpx.AsyncClient, base: str, body: Json, path: str = "") -> Json:
    """``POST base + path`` (default: chat completions, or completions for a ``prompt``)."""
    path = path or ("/v1/completions" if "prompt" in body else "/v1/chat/completions")
    response = await client.post(f"{base}{path}", json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


async def streamed(client: httpx.AsyncClient, base: str, body: Json, path: str = "") -> list[Json]:
    """The events of the same request streamed, up to ``[DONE]`` (which must end it)."""
    path = path or ("/v1/completions" if "prompt" in body else "/v1/chat/completions")
    async with client.stream("POST", f"{base}{path}", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line[6:]) for line in lines[:-1]]


def no_whitespace(model_dir: Path) -> dict[int, float]:
    """A logit bias against the model's whitespace-only tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {
        i: -100.0
        for i in range(len(tokenizer))
        if i not in tokenizer.all_special_ids and not tokenizer.decode([i]).strip()
    }
