"""Text prompts tokenized in the router (``route --tokenizer DIR``, or the tokenizer a server
hands over), on a real engine server: the same ids as the server's tokenizer (the reference,
checked once by the router itself), no Tokenize call per request, and a tokenizer that is not
the served model's is never used."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from skyrl_grpc.names import DETOKENIZE, GET_TOKENIZER, TOKENIZE
from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
from tests.conftest import running_router

pytestmark = [pytest.mark.engine]
TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "naïve café, 1234 résumé",
    "emoji 🙂 and 中文 text",
    "line\nbreaks\tand tabs",
]


def processed_calls(router: Any, method: str) -> float:
    """How many ``method`` calls the router has handled itself."""
    return float(
        sum(
            sample.value
            for metric in router.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == "skyrl_router_processed_requests_total"
            and sample.labels["method"] == method
        )
    )


def tokenize_calls(router: Any) -> float:
    return processed_calls(router, TOKENIZE)


async def prompt_ids(router: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    body = {
        "model": "",
        "prompt": text,
        "max_tokens": 1,
        "return_token_ids": True,
        "add_special_tokens": add_special_tokens,
    }
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as client:
        answer = await client.post("/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(json.loads(answer.text)["choices"][0]["prompt_token_ids"])


async def server_ids(engine_server: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    import grpc

    async with grpc.aio.insecure_channel(engine_server.address) as channel:
        answer = await data_plane_pb2_grpc.DataPlaneStub(channel).Tokenize(
            data_plane_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        )
    return list(answer.token_ids)


async def test_text_prompts_are_tokenized_in_the_router_as_the_server_does(
    engine_server: Any, tiny_model_dir: Path
) -> None:
    async for router in running_router(
        [engine_server.address], http_port=0, tokenizer=str(tiny_model_dir)
    ):
        for text in TEXTS:
            for special in (True, False):
                ours = await prompt_ids(router, text, special)
                assert ours == await server_ids(engine_server, text, special), text
        # Only the router's one check (with and without special tokens) asked a server.
        assert tokenize_calls(router) == 2


async def test_a_tokenizer_that_is_not_the_served_models_is_not_used(
    engine_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    vocab[","], vocab["!"] = vocab["!"], vocab[","]  # two ids swapped (the check's text has both)
    (tmp_path / "tokenizer.json").write_text(json.dumps(other))
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    async for router in running_router(
        [engine_server.address], http_port=0, tokenizer=str(tmp_path)
    ):
        for text in TEXTS[:2]:
            assert await prompt_ids(router, text) == await server_ids(engine_server, text)
        # The check stopped at the difference (its first probe): every prompt was tokenized
        # by the server.
        assert tokenize_calls(router) == 1 + 2


def get_tokenizer_calls(router: Any) -> float:
    return processed_calls(router, GET_TOKENIZER)


@pytest.mark.parametrize("given", ["none", "a directory this host lacks"])
async def test_a_router_without_the_models_files_tokenizes_with_the_servers_tokenizer(
    engine_server: Any, tmp_path: Path, given: str
) -> None:
    """No --tokenizer, or one naming files this host does not have: the router reads the
    tokenizer from a server once (GetTokenizer), checks it as it checks its own, and
    tokenizes text prompts itself, with the servers' ids."""
    tokenizer = None if given == "none" else str(tmp_path / "not-here")
    async for router in running_router([engine_server.address], http_port=0, tokenizer=tokenizer):
        for text in TEXTS:
            for special in (True, False):
                ours = await prompt_ids(router, text, special)
                assert ours == await server_ids(engine_server, text, special), text
        assert get_tokenizer_calls(router) == 1
        assert tokenize_calls(router) == 2  # the check, nothing per prompt


def detokenize_calls(router: Any) -> float:
    return processed_calls(router, DETOKENIZE)


async def logprobs_answer(router: Any, prompt: str) -> Any:
    """A greedy completion naming each token and two alternatives by their texts."""
    body = {"model": "", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as client:
        answer = await client.post("/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return json.loads(answer.text)["choices"][0]["logprobs"]


async def test_token_texts_are_decoded_in_the_router_once_it_decodes_as_the_server(
    engine_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The router's own tokenizer names a logprobs answer's tokens after one check against a
    server's Detokenize (no call per token from then on); one that decodes otherwise (here: its
    file without the byte-level decoder) is not used for them, and both answers are the same."""
    broken = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    broken["decoder"] = None  # the same ids, other texts ("Ġ" for a space)
    (tmp_path / "tokenizer.json").write_text(json.dumps(broken))
    answers, calls = [], []
    for directory in (tiny_model_dir, tmp_path):
        async for router in running_router(
            [engine_server.address], http_port=0, tokenizer=str(directory)
        ):
            first = await logprobs_answer(router, TEXTS[2])
            checked = detokenize_calls(router)
            # Other tokens: texts this router has not named before.
            second = await logprobs_answer(router, TEXTS[3])
            answers.append((first, second))
            calls.append((checked, detokenize_calls(router) - checked))
    assert answers[0] == answers[1] and answers[0][1]["tokens"]
    (checked, later), (_, broken_later) = calls
    assert checked > 0 and later == 0  # the check alone asked the server
    assert broken_later > 0  # texts still come from the server: this tokenizer was refused
