"""vLLM's token-in / token-out request and answer shapes at the edge
(``servers.router.http_edge.token_generate``), without a network."""

from __future__ import annotations

import json

import pytest

from servers.router.http_edge import token_generate
from skyrl_grpc.errors import InvalidArgument
from skyrl_grpc.v1 import generation_pb2 as gen


def test_a_generate_request_reads_vllms_sampling_names() -> None:
    call = token_generate.read_generate(
        {
            "token_ids": [1, 2, 3],
            "model": "policy",
            "request_id": "r-7",
            "sampling_params": {
                "temperature": 0.5,
                "max_tokens": 9,
                "stop": ["\n"],
                "stop_token_ids": [4],
                "logprobs": 1,
                "prompt_logprobs": 0,
                "n": 2,
                "seed": 3,
            },
        }
    )
    assert call.prompts == [[1, 2, 3]] and call.model == "policy" and call.id == "r-7"
    assert call.n == 2 and not call.chat and not call.stream
    p = call.sampling
    assert (p.temperature, p.max_tokens, p.seed, p.logprobs) == (0.5, 9, 3, 1)
    assert list(p.stop_strings) == ["\n"] and list(p.stop_token_ids) == [4]
    assert p.HasField("prompt_logprobs") and p.prompt_logprobs == 0
    # vLLM's default budget when none is given.
    default = token_generate.read_generate({"token_ids": [1], "sampling_params": {}})
    assert default.sampling.max_tokens == 16 and default.id.startswith("gen-")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"token_ids": [1], "sampling_params": {"best_of_n": 2}}, "best_of_n"),
        ({"token_ids": [1], "features": {}}, "features"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "output_mode": "text"}, "output_mode"),
        ({"token_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"token_ids": [1], "sampling_params": []}, "sampling_params"),
    ],
)
def test_what_the_edge_cannot_honour_is_refused_by_name(
    body: dict[str, object], words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        token_generate.read_generate(body)


def test_a_choice_carries_tokens_logprobs_and_weight_versions() -> None:
    sample = gen.Sample(
        index=1,
        token_ids=[5, 6, 7],
        logprobs=gen.Logprobs(
            token_logprobs=[-0.1, -0.2, -0.3],
            top_logprobs=[gen.TopLogprobs(token_ids=[5, 9], logprobs=[-0.1, -2.0])] * 3,
        ),
        weight_versions=[
            gen.WeightVersionSpan(weight_version=3, start=0, length=2),
            gen.WeightVersionSpan(weight_version=4, start=2, length=1),
        ],
    )
    choice = token_generate.choice(sample, "length", None, 1)
    assert choice["token_ids"] == [5, 6, 7] and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == [5, 6, 7]
    assert content[0]["top_logprobs"][1] == {"token_id": 9, "logprob": -2.0, "rank": 2}
    assert choice["weight_versions"] == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 3},
    ]


def test_a_render_is_the_generate_request_that_serves_it() -> None:
    from servers.router.http_edge.parse import read_generation

    call = read_generation(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stop": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object"}},
            },
        },
        chat=True,
    )
    rendered = token_generate.render_response(call, [1, 2, 3])
    assert rendered["token_ids"] == [1, 2, 3]
    sampling = rendered["sampling_params"]
    assert sampling["max_tokens"] == 5 and sampling["stop"] == ["x"] and sampling["n"] == 1
    assert sampling["structured_outputs"] == {"json": {"type": "object"}}
    again = token_generate.read_generate(json.loads(json.dumps(
        {k: v for k, v in rendered.items() if k != "features"}
    )))  # fmt: skip
    assert again.prompts == [[1, 2, 3]] and again.sampling.max_tokens == 5
    assert again.sampling.structured_output.json_schema == '{"type": "object"}'


def test_output_kind_is_accepted_as_vllm_names_it_and_other_values_refused() -> None:
    # SkyRL's sample() sends FINAL_ONLY (2); a whole answer is the same for every kind.
    call = token_generate.read_generate(
        {"token_ids": [1, 2], "sampling_params": {"output_kind": 2, "max_tokens": 3}}
    )
    assert call.sampling.max_tokens == 3
    with pytest.raises(InvalidArgument, match="output_kind"):
        token_generate.read_generate({"token_ids": [1], "sampling_params": {"output_kind": 7}})
