"""Resuming a cut generation (``skyrl_grpc.continuation``) and the router's stream migration
(``servers.router.migration``), without a network."""

from __future__ import annotations

import numpy as np

from servers.router.migration import StreamMigration
from skyrl_grpc import routed_experts
from skyrl_grpc.continuation import continue_request
from skyrl_grpc.names import GENERATE_STREAM
from skyrl_grpc.v1 import data_plane_pb2, generation_pb2

Request = data_plane_pb2.GenerateStreamRequest
Chunk = data_plane_pb2.GenerateStreamResponse


def request(**params: object) -> Request:
    return Request(
        request_id="r-1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=generation_pb2.SamplingParams(**params),  # type: ignore[arg-type]
        include_text=True,
        stream_interval=16,
    )


def chunk(tokens: list[int], finish: int = 0, request_id: str = "r-1", version: int = 0) -> bytes:
    return Chunk(
        request_id=request_id,
        weight_version=version,
        token_ids=tokens,
        finish_reason=finish,  # type: ignore[arg-type]
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=len(tokens)),
        prompt_logprobs=generation_pb2.Logprobs(token_logprobs=[0.0, -1.0, -2.0]),
    ).SerializeToString()


def test_a_continuation_extends_the_prompt_and_spends_the_budget() -> None:
    original = request(max_tokens=10, min_tokens=4, prompt_logprobs=2, temperature=0.5)
    continued = continue_request(original, [7, 8, 9], 0)
    assert list(continued.prompt_token_ids) == [1, 2, 3, 7, 8, 9]
    assert continued.sampling_params.max_tokens == 7
    assert continued.sampling_params.min_tokens == 1
    assert not continued.sampling_params.HasField("prompt_logprobs")
    assert continued.sampling_params.temperature == 0.5
    assert continued.request_id == "r-1" and continued.include_text
    assert continued.stream_interval == 16
    # The original is left as it was.
    assert list(original.prompt_token_ids) == [1, 2, 3]
    assert original.sampling_params.max_tokens == 10
    unbounded = continue_request(request(min_tokens=2), [5, 5, 5], 0)
    assert not unbounded.sampling_params.HasField("max_tokens")  # the context bounds it
    assert unbounded.sampling_params.min_tokens == 0


def test_a_continuation_goes_on_no_older_than_its_tokens_weights() -> None:
    """A continuation names its tokens' newest weight version (``min_weight_version``), never
    less than the floor the request already had."""
    assert continue_request(request(max_tokens=9), [4, 5], 4).min_weight_version == 4
    floored = request(max_tokens=9)
    floored.min_weight_version = 6
    assert continue_request(floored, [4], 4).min_weight_version == 6
    assert continue_request(floored, [4], 7).min_weight_version == 7


def test_a_migration_moves_only_to_weights_as_new_as_its_tokens() -> None:
    """The stream's floor is the newest version among its tokens (a final chunk with no token,
    stamped later, does not count), read from the unparsed chunks and from a continuation's."""
    migration = StreamMigration(request(max_tokens=20), max_migrations=3)
    assert migration.min_version == 0
    migration.observe(chunk([10], version=3))
    migration.observe(chunk([11, 12], version=4))
    assert migration.min_version == 4
    continuation = Request.FromString(migration.continuation("10.0.0.1:1"))
    assert continuation.min_weight_version == 4
    migration.observe(chunk([13], version=5))
    migration.observe(chunk([], version=9))  # no token: nothing was made at 9
    assert migration.min_version == 5
    assert Request.FromString(migration.continuation("10.0.0.2:1")).min_weight_version == 5


def test_a_migrated_stream_asks_for_the_routed_experts_after_those_it_forwarded() -> None:
    """Each message carries its steps' routing (the prompt's from its start on the first, then
    a row per token before the message's last): a continuation starts where the rows the
    caller has end, each time it moves, so no token's row comes twice."""
    original = request(max_tokens=20, return_routed_experts=True, routed_experts_prompt_start=1)
    migration = StreamMigration(original, max_migrations=3)

    def with_rows(tokens: list[int], rows: int) -> bytes:
        message = Chunk.FromString(chunk(tokens))
        experts = np.zeros((rows, 2, 2), dtype=np.uint8)
        message.routed_experts.CopyFrom(routed_experts.pack(experts))
        return message.SerializeToString()

    migration.observe(with_rows([10], 2))  # the prompt's 3 tokens from 1
    migration.observe(with_rows([11, 12], 2))
    first = Request.FromString(migration.continuation("10.0.0.1:1"))
    assert list(first.prompt_token_ids) == [1, 2, 3, 10, 11, 12]
    assert first.sampling_params.routed_experts_prompt_start == 1 + 4  # the rows it forwarded
    migration.observe(with_rows([13], 1))  # from the continuation: the row of 12
    second = Request.FromString(migration.continuation("10.0.0.2:1"))
    assert second.sampling_params.routed_experts_prompt_start == 1 + 5
    plain = StreamMigration(request(max_tokens=20), max_migrations=3)
    plain.observe(chunk([10, 11]))
    assert Request.FromString(plain.continuation("10.0.0.1:1")).sampling_params == (
        generation_pb2.SamplingParams(max_tokens=18)
    )


def test_only_single_sample_generate_streams_migrate() -> None:
    raw = request(max_tokens=5).SerializeToString()
    assert StreamMigration.for_call(GENERATE_STREAM, raw, 2) is not None
    assert StreamMigration.for_call(GENERATE_STREAM, raw, 0) is None
    assert StreamMigration.for_call("/skyrl.inference.v1.DataPlane/Generate", raw, 2) is None
    several = Request(prompt_token_ids=[1], n=3).SerializeToString()
    assert StreamMigration.for_call(GENERATE_STREAM, several, 2) is None
    assert StreamMigration.for_call(GENERATE_STREAM, b"\xff\xff", 2) is None


def test_a_migrated_stream_reads_as_one_uninterrupted_stream() -> None:
    migration = StreamMigration.for_call(
        GENERATE_STREAM, request(max_tokens=6, prompt_logprobs=1).SerializeToString(), 2
    )
    assert migration is not None
    first, second = chunk([10, 11]), chunk([12])
    # Before a migration, chunks pass through untouched (the hot path parses nothing).
    assert migration.observe(first) is first and migration.observe(second) is second
    assert migration.can_migrate()
    continuation = Request.FromString(migration.continuation("10.0.0.1:1"))
    assert list(continuation.prompt_token_ids) == [1, 2, 3, 10, 11, 12]
    assert continuation.sampling_params.max_tokens == 3
    assert not continuation.sampling_params.HasField("prompt_logprobs")
    # The new backend numbers its own usage and may name the request differently: rewritten.
    rewritten = Chunk.FromString(migration.observe(chunk([13], request_id="server-assigned-id")))
    assert rewritten.request_id == "r-1"
    assert rewritten.usage.prompt_tokens == 3 and rewritten.usage.completion_tokens == 4
    assert not rewritten.HasField("prompt_logprobs")
    assert migration.tokens == [10, 11, 12, 13]
    assert migration.can_migrate()
    Request.FromString(migration.continuation("10.0.0.2:1"))
    assert not migration.can_migrate()  # two migrations were allowed, both used
    assert migration.lost == ["10.0.0.1:1", "10.0.0.2:1"]


def test_a_finished_stream_does_not_migrate() -> None:
    migration = StreamMigration.for_call(GENERATE_STREAM, request().SerializeToString(), 2)
    assert migration is not None
    migration.observe(chunk([1, 2], finish=generation_pb2.FINISH_REASON_LENGTH))
    assert not migration.can_migrate()


def test_a_constrained_stream_migrates_only_before_its_first_token() -> None:
    """The engine compiles a constraint for a whole output: continuing one mid-way would start
    it over inside the output, so such a stream fails over only while nothing was sent."""
    from skyrl_grpc.continuation import resumable

    schema = generation_pb2.StructuredOutput(json_object=True)
    constrained = request(max_tokens=9, structured_output=schema)
    with_tools = request(max_tokens=9)
    with_tools.chat_output.tool_use.tools.add(name="f")
    plain_chat = request(max_tokens=9)
    plain_chat.chat_output.whole_messages = True
    assert not resumable(constrained) and not resumable(with_tools)
    assert resumable(plain_chat) and resumable(request(max_tokens=9))
    for held in (constrained, with_tools):
        migration = StreamMigration(held, max_migrations=2)
        assert migration.can_migrate()  # nothing sent yet: a plain retry elsewhere
        migration.observe(chunk([4, 5]))
        assert not migration.can_migrate()
    migration = StreamMigration(plain_chat, max_migrations=2)
    migration.observe(chunk([4, 5]))
    assert migration.can_migrate()
    # The continuation tells the chat parser which prompt tokens are the sample's own.
    continued = continue_request(continue_request(plain_chat, [4, 5], 0), [6], 0)
    assert continued.chat_output.resumed_tokens == 3
    assert list(continued.prompt_token_ids) == [1, 2, 3, 4, 5, 6]
