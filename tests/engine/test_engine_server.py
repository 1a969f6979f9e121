"""The engine server against real vLLM on CPU: generation, pause modes, cancel, errors.

One engine serves the whole module (session fixture); each test leaves it idle and resumed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from skyrl_grpc.v1 import control_plane_pb2 as cp
from skyrl_grpc.v1 import control_plane_pb2_grpc, data_plane_pb2, data_plane_pb2_grpc
from skyrl_grpc.v1 import generation_pb2 as gen
from tests.conftest import REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS, offline_reference
from tests.helpers.streams import stream_request
from tests.helpers.waits import engine_idle, until

pytestmark = [pytest.mark.engine]
SP = gen.SamplingParams
LONG = SP(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def data(engine_channel: grpc.aio.Channel) -> data_plane_pb2_grpc.DataPlaneAsyncStub:
    return data_plane_pb2_grpc.DataPlaneStub(engine_channel)


@pytest.fixture
def control(engine_channel: grpc.aio.Channel) -> control_plane_pb2_grpc.ControlPlaneAsyncStub:
    return control_plane_pb2_grpc.ControlPlaneStub(engine_channel)


@pytest.fixture(autouse=True)
async def leave_engine_resumed_and_idle(engine_channel: grpc.aio.Channel) -> Any:
    yield
    control = control_plane_pb2_grpc.ControlPlaneStub(engine_channel)
    await control.Resume(cp.ResumeRequest())
    await engine_idle(control)


async def greedy(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub, prompt: list[int], max_tokens: int
) -> list[int]:
    response = await data.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling_params=SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
    )
    return list(response.samples[0].token_ids)


class StreamWatcher:
    """Consumes one generation stream in the background, recording chunks and arrival times."""

    def __init__(
        self,
        data: data_plane_pb2_grpc.DataPlaneAsyncStub,
        request: data_plane_pb2.GenerateStreamRequest,
    ):
        self.call = data.GenerateStream(request)
        self.tokens: list[int] = []
        self.chunks: list[data_plane_pb2.GenerateStreamResponse] = []
        self.times: list[float] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for chunk in self.call:
            self.chunks.append(chunk)
            self.tokens.extend(chunk.token_ids)
            self.times.append(time.monotonic())

    @property
    def finish_reason(self) -> int:
        return self.chunks[-1].finish_reason if self.chunks else 0

    async def until_tokens(self, count: int) -> None:
        await until(lambda: len(self.tokens) >= count or self.task.done(), what=f"{count} tokens")
        assert len(self.tokens) >= count, "stream ended early"


# -- generation ---------------------------------------------------------------------------------


async def test_greedy_equals_vllm_offline_generate(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
    greedy_reference: list[dict[str, Any]],
) -> None:
    version = (await control.GetServerInfo(cp.GetServerInfoRequest())).weight_version
    for prompt, reference in zip(REFERENCE_PROMPTS, greedy_reference, strict=True):
        response = await data.Generate(
            data_plane_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling_params=SP(
                    temperature=0.0, max_tokens=REFERENCE_MAX_TOKENS, logprobs=0, ignore_eos=True
                ),
            )
        )
        sample = response.samples[0]
        assert list(sample.token_ids) == reference["token_ids"]
        assert list(sample.logprobs.token_logprobs) == pytest.approx(
            reference["logprobs"], abs=1e-3
        )
        assert sample.finish_reason == gen.FINISH_REASON_LENGTH
        assert [(s.weight_version, s.start, s.length) for s in sample.weight_versions] == [
            (version, 0, REFERENCE_MAX_TOKENS)
        ]
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == REFERENCE_MAX_TOKENS


async def test_streamed_tokens_equal_unary_result(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    prompt = REFERENCE_PROMPTS[0]
    params = SP(temperature=0.0, max_tokens=20, ignore_eos=True)
    chunks = [
        c async for c in data.GenerateStream(stream_request(prompt, params, request_id="stream-eq"))
    ]
    assert all(c.request_id == "stream-eq" for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == gen.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 20
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == await greedy(data, prompt, 20)


async def test_stream_interval_coalesces_chunks_without_changing_tokens(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    prompt = REFERENCE_PROMPTS[1]
    params = SP(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    chunks = [
        c async for c in data.GenerateStream(stream_request(prompt, params, stream_interval=8))
    ]
    sizes = [len(c.token_ids) for c in chunks]
    # The first token at once, then messages of at least 8 until the last one.
    assert sizes[0] >= 1 and all(size >= 8 for size in sizes[1:-1]), sizes
    assert len(chunks) <= 1 + 30 // 8 + 1
    assert chunks[-1].finish_reason == gen.FINISH_REASON_LENGTH
    assert [t for c in chunks for t in c.token_ids] == await greedy(data, prompt, 30)
    assert sum(len(c.logprobs.token_logprobs) for c in chunks) == 30


async def test_seeded_sampling_is_reproducible(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    async def sample(seed: int) -> list[int]:
        response = await data.Generate(
            data_plane_pb2.GenerateRequest(
                prompt_token_ids=REFERENCE_PROMPTS[1],
                sampling_params=SP(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True),
            )
        )
        return list(response.samples[0].token_ids)

    first, again, other = await sample(7), await sample(7), await sample(8)
    assert first == again
    assert first != other


async def test_the_status_stream_reports_the_seed_the_sampler_started_with(
    engine_server: Any, second_engine_server: Any
) -> None:
    """What a router names servers that sample alike by (``sampling_seed``)."""
    from skyrl_grpc.v1 import status_pb2, status_pb2_grpc

    seeds = []
    for server in (engine_server, second_engine_server):
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = status_pb2_grpc.ServerStatusStub(channel).Watch(status_pb2.WatchRequest())
            status = await call.read()
            call.cancel()
        assert isinstance(status, status_pb2.WatchResponse) and status.HasField("sampling_seed")
        seeds.append(status.sampling_seed)
    assert seeds == [0, 1]  # the default, and the second server's own (tests/conftest.py)


async def test_n_samples_are_independent_and_indexed(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    response = await data.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=REFERENCE_PROMPTS[0],
            sampling_params=SP(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True),
            n=4,
        )
    )
    assert [s.index for s in response.samples] == [0, 1, 2, 3]
    assert all(len(s.token_ids) == 12 for s in response.samples)
    assert len({tuple(s.token_ids) for s in response.samples}) > 1
    assert response.usage.completion_tokens == 48


async def test_top_logprobs_and_prompt_logprobs(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    prompt = REFERENCE_PROMPTS[2]
    response = await data.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling_params=SP(
                temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=1, ignore_eos=True
            ),
        )
    )
    sample = response.samples[0]
    assert len(sample.logprobs.token_logprobs) == 6
    for token, logprob, top in zip(
        sample.token_ids, sample.logprobs.token_logprobs, sample.logprobs.top_logprobs, strict=True
    ):
        assert len(top.token_ids) == 3
        assert top.token_ids[0] == token  # greedy: the sampled token is the most likely
        assert top.logprobs[0] == pytest.approx(logprob)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
    assert len(response.prompt_logprobs.token_logprobs) == len(prompt)
    assert response.prompt_logprobs.token_logprobs[0] == 0.0
    assert all(lp < 0 for lp in response.prompt_logprobs.token_logprobs[1:])


async def test_stop_token_and_stop_string(data: data_plane_pb2_grpc.DataPlaneAsyncStub) -> None:
    prompt = REFERENCE_PROMPTS[0]
    free = await greedy(data, prompt, 20)
    stop_token = free[5]
    first_hit = free.index(stop_token)
    response = await data.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling_params=SP(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
        )
    )
    sample = response.samples[0]
    assert list(sample.token_ids) == free[: first_hit + 1]
    assert sample.finish_reason == gen.FINISH_REASON_STOP
    assert sample.stop.token_id == stop_token

    text = (await data.Detokenize(data_plane_pb2.DetokenizeRequest(token_ids=free))).text
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    response = await data.Generate(
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling_params=SP(temperature=0.0, max_tokens=20, stop_strings=[stop_string]),
            include_text=True,
        )
    )
    sample = response.samples[0]
    assert sample.finish_reason == gen.FINISH_REASON_STOP
    assert sample.stop.text == stop_string
    assert stop_string not in sample.text and text.startswith(sample.text)


async def test_chat_and_completion_and_tokenizer(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    messages = [data_plane_pb2.ChatMessage(role="user", content="The trainer sends new weights")]
    rendered = await data.Tokenize(
        data_plane_pb2.TokenizeRequest(
            conversation=data_plane_pb2.ChatConversation(messages=messages)
        )
    )
    info = await data.GetModelInfo(data_plane_pb2.GetModelInfoRequest())
    assert rendered.token_ids[0] == info.bos_token_id
    chat = await data.Chat(
        data_plane_pb2.ChatRequest(
            messages=messages, sampling_params=SP(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
    )
    assert list(chat.prompt_token_ids) == list(rendered.token_ids)
    assert list(chat.samples[0].token_ids) == await greedy(data, list(rendered.token_ids), 8)
    decoded = await data.Detokenize(
        data_plane_pb2.DetokenizeRequest(token_ids=chat.samples[0].token_ids)
    )
    assert chat.samples[0].text == decoded.text

    completion = await data.Complete(
        data_plane_pb2.CompleteRequest(
            prompt="The router streams",
            sampling_params=SP(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    )
    tokens = await data.Tokenize(data_plane_pb2.TokenizeRequest(text="The router streams"))
    assert list(completion.prompt_token_ids) == list(tokens.token_ids)
    assert tokens.token_ids[0] == info.bos_token_id
    back = await data.Detokenize(data_plane_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
    assert back.text == "The router streams"


async def test_model_info(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    info = await data.GetModelInfo(data_plane_pb2.GetModelInfoRequest())
    assert info.served_model_name == "skyrl-tiny-llama"
    assert info.vocab_size == 2048 and info.max_context_length == 512
    assert info.has_chat_template and list(info.eos_token_ids) == [2]
    server = await control.GetServerInfo(cp.GetServerInfoRequest())
    assert server.world_size == 1 and server.tensor_parallel_size == 1
    assert server.weight_group_ranks == 1
    assert server.engine == "vllm" and server.engine_version == "0.32.0" and server.device == "cpu"
    assert not server.capabilities.sleep
    assert set(server.capabilities.pause_modes) == {
        cp.PAUSE_MODE_ABORT,
        cp.PAUSE_MODE_WAIT,
        cp.PAUSE_MODE_KEEP,
    }


# -- abort, cancel, deadline --------------------------------------------------------------------


async def test_abort_by_request_id_ends_stream_with_aborted(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    watcher = StreamWatcher(data, stream_request(REFERENCE_PROMPTS[0], LONG, request_id="to-abort"))
    await watcher.until_tokens(3)
    aborted = await data.Abort(data_plane_pb2.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert list(aborted.aborted_request_ids) == ["to-abort"]
    await asyncio.wait_for(watcher.task, 60)
    assert watcher.finish_reason == gen.FINISH_REASON_ABORTED
    assert 3 <= len(watcher.tokens) < 400
    await engine_idle(control)


async def test_duplicate_in_flight_request_id_is_already_exists(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    watcher = StreamWatcher(data, stream_request(REFERENCE_PROMPTS[0], LONG, request_id="dup"))
    await watcher.until_tokens(1)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await data.Generate(
            data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], request_id="dup")
        )
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    watcher.call.cancel()


async def test_an_aborted_id_is_free_at_once_though_its_stream_has_not_ended(
    engine_server: Any, data: data_plane_pb2_grpc.DataPlaneAsyncStub
) -> None:
    """A server cut off from its caller still runs the request that caller lost, and the
    stream ends only once its dead connection is found (what the caller is not reading stays
    unread meanwhile). The caller, a router moving the stream back here, aborts it and sends
    it again under the same id: that must not wait for the orphan's end."""
    from vllm import SamplingParams

    engine = engine_server.state.parts().engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    orphan = engine.generate("moved-back", REFERENCE_PROMPTS[0], params, lambda out: [out])
    await orphan.__anext__()  # running; then nobody reads it, as on a dead connection
    assert await engine.abort(["moved-back"]) == ["moved-back"]
    again = stream_request(REFERENCE_PROMPTS[0], SP(max_tokens=4), request_id="moved-back")
    tokens = [t async for chunk in data.GenerateStream(again) for t in chunk.token_ids]
    assert len(tokens) == 4
    await orphan.aclose()  # the orphan's end, found at last, frees nothing another holds
    watcher = StreamWatcher(
        data, stream_request(REFERENCE_PROMPTS[0], LONG, request_id="moved-back")
    )
    await watcher.until_tokens(1)
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # still one request per id at a time
        await data.Generate(
            data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], request_id="moved-back")
        )
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    watcher.call.cancel()


async def test_client_cancel_aborts_request_in_engine(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    watcher = StreamWatcher(data, stream_request(REFERENCE_PROMPTS[0], LONG))
    await watcher.until_tokens(2)
    busy = await control.GetLoad(cp.GetLoadRequest())
    assert busy.running_requests + busy.waiting_requests == 1
    watcher.call.cancel()
    load = await engine_idle(control)
    assert load.running_requests == 0


async def test_deadline_ends_with_deadline_exceeded_and_engine_idle(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await data.Generate(
            data_plane_pb2.GenerateRequest(
                prompt_token_ids=REFERENCE_PROMPTS[0],
                sampling_params=SP(max_tokens=480, ignore_eos=True),
            ),
            timeout=0.3,
        )
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await engine_idle(control)


# -- pause modes --------------------------------------------------------------------------------

CONCURRENT = 8


def prompts_for(count: int) -> list[list[int]]:
    return [[1, 10 + i, 200 + i, 30 + i] for i in range(count)]


async def test_pause_abort_ends_streams_with_tokens_so_far(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    watchers = [StreamWatcher(data, stream_request(p, LONG)) for p in prompts_for(CONCURRENT)]
    for w in watchers:
        await w.until_tokens(2)
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_ABORT))
    await asyncio.wait_for(asyncio.gather(*(w.task for w in watchers)), 5)
    for w in watchers:
        assert w.finish_reason == gen.FINISH_REASON_ABORTED
        assert 2 <= len(w.tokens) < 400
        assert w.chunks[-1].usage.completion_tokens == len(w.tokens)
    assert (await control.IsPaused(cp.IsPausedRequest())).paused
    await control.Resume(cp.ResumeRequest())
    assert not (await control.IsPaused(cp.IsPausedRequest())).paused


async def test_pause_wait_returns_after_in_flight_requests_finish(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    params = SP(temperature=0.0, max_tokens=60, ignore_eos=True)
    watchers = [StreamWatcher(data, stream_request(p, params)) for p in prompts_for(CONCURRENT)]
    for w in watchers:
        await w.until_tokens(1)
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_WAIT))
    returned = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(w.task for w in watchers)), 10)
    for w in watchers:
        assert w.finish_reason == gen.FINISH_REASON_LENGTH and len(w.tokens) == 60
        assert w.times[-1] <= returned  # every request had finished before pause returned


async def test_pause_keep_freezes_and_resumes_with_nothing_lost(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    params = SP(temperature=0.0, max_tokens=120, ignore_eos=True)
    prompts = prompts_for(CONCURRENT)
    expected = [await greedy(data, p, 120) for p in prompts]
    watchers = [StreamWatcher(data, stream_request(p, params)) for p in prompts]
    for w in watchers:
        await w.until_tokens(2)
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_KEEP))
    # As long as ten steps took before the pause, on this machine now: an engine that went on
    # generating would have sent tokens in that time however slow the machine (a fixed sleep
    # could be shorter than one step on a busy one).
    step = max(b - a for w in watchers for a, b in itertools.pairwise(w.times))

    async def gone_quiet() -> list[int]:
        """The streams' tokens once none came for two steps: what the last step before the
        pause made may still be on its way when Pause answers (a busy machine's client reads
        it later), and an engine still generating never goes quiet."""
        counts = [len(w.tokens) for w in watchers]
        while True:
            await asyncio.sleep(max(0.25, 2 * step))
            now = [len(w.tokens) for w in watchers]
            if now == counts:
                return now
            counts = now

    try:
        frozen = await asyncio.wait_for(gone_quiet(), max(30.0, 100 * step))
    except TimeoutError:
        pytest.fail("tokens kept arriving after Pause(KEEP) answered")
    await asyncio.sleep(max(0.5, 10 * step))
    assert [len(w.tokens) for w in watchers] == frozen, "tokens arrived while paused"
    assert all(not w.task.done() for w in watchers)
    await control.Resume(cp.ResumeRequest())
    await asyncio.wait_for(asyncio.gather(*(w.task for w in watchers)), 120)
    for w, want in zip(watchers, expected, strict=True):
        assert w.finish_reason == gen.FINISH_REASON_LENGTH
        assert w.tokens == want


async def test_requests_arriving_while_paused_wait_for_resume(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    await control.Pause(cp.PauseRequest(mode=cp.PAUSE_MODE_ABORT))
    prompt = REFERENCE_PROMPTS[1]
    pending = asyncio.ensure_future(greedy(data, prompt, 10))

    async def held() -> bool:
        load = await control.GetLoad(cp.GetLoadRequest())
        assert load.paused and not pending.done(), "a request ran while the server was paused"
        return load.waiting_requests == 1 and load.running_requests == 0

    # Held by the pause (waiting for Resume, not running): a request that ran would end the
    # wait with the assertion, or never be seen waiting.
    await until(held, what="the request waiting for Resume")
    assert not pending.done(), "a request ran while the server was paused"
    await control.Resume(cp.ResumeRequest())
    tokens = await asyncio.wait_for(pending, 60)
    assert tokens == await greedy(data, prompt, 10)


# -- control plane odds and ends ----------------------------------------------------------------


async def test_sleep_is_failed_precondition_on_cpu(
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    for call in (control.Sleep(cp.SleepRequest(level=1)), control.WakeUp(cp.WakeUpRequest())):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not supported on cpu" in (raised.value.details() or "")
    assert not (await control.IsSleeping(cp.IsSleepingRequest())).sleeping


async def test_reset_prefix_cache(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    prompt = [1 + (i * 7) % 2000 for i in range(300)]  # spans several KV blocks (128 on CPU)
    await greedy(data, prompt, 2)
    cached = await data.Generate(
        data_plane_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=SP(max_tokens=2))
    )
    assert cached.usage.cached_prompt_tokens > 0
    await control.ResetPrefixCache(cp.ResetPrefixCacheRequest())
    fresh = await data.Generate(
        data_plane_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=SP(max_tokens=2))
    )
    assert fresh.usage.cached_prompt_tokens == 0


# -- invalid input ------------------------------------------------------------------------------

INVALID_GENERATE = [
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 5000]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the vocabulary",
    ),
    (data_plane_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "is empty"),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1] * 600),
        grpc.StatusCode.INVALID_ARGUMENT,
        "context is 512 tokens",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=SP(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens = 0",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=SP(max_tokens=600)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "use max_tokens <= 510",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], n=-2),
        grpc.StatusCode.INVALID_ARGUMENT,
        "n = -2",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=SP(temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=SP(top_p=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=SP(top_p=1.01)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    (
        data_plane_pb2.GenerateRequest(
            prompt_token_ids=[1, 2], sampling_params=SP(temperature=0), n=2
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "greedy",
    ),
    # Larger than the server's 64 MiB message limit: refused before decoding, naming it.
    (
        data_plane_pb2.GenerateRequest(prompt_token_ids=[1], request_id="x" * (65 << 20)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "--max-message-mib 64 allows",
    ),
]


@pytest.mark.parametrize(("request_message", "code", "fragment"), INVALID_GENERATE)
async def test_invalid_generate_gets_clear_status_and_server_keeps_serving(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    request_message: data_plane_pb2.GenerateRequest,
    code: grpc.StatusCode,
    fragment: str,
) -> None:
    for call in (data.Generate(request_message), _drain_stream(data, request_message)):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == code, raised.value.details()
        assert fragment in (raised.value.details() or "")
    assert len(await greedy(data, [1, 2, 3], 3)) == 3


async def _drain_stream(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub, request: data_plane_pb2.GenerateRequest
) -> None:
    stream_message = data_plane_pb2.GenerateStreamRequest.FromString(request.SerializeToString())
    async for _ in data.GenerateStream(stream_message):
        pass


async def test_invalid_control_and_tokenizer_input(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
    control: control_plane_pb2_grpc.ControlPlaneAsyncStub,
) -> None:
    cases = [
        (control.Pause(cp.PauseRequest(mode=42)), "mode = 42 is not a PauseMode"),  # type: ignore[arg-type]
        (control.Sleep(cp.SleepRequest(level=5)), "sleep level must be 1 or 2"),
        (
            data.Detokenize(data_plane_pb2.DetokenizeRequest(token_ids=[9999])),
            "outside the vocabulary",
        ),
        (data.Chat(data_plane_pb2.ChatRequest()), "messages is empty"),
    ]
    for call, fragment in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await cast(Awaitable[object], call)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in (raised.value.details() or "")
    assert not (await control.IsPaused(cp.IsPausedRequest())).paused
    assert len(await greedy(data, [1, 2, 3], 3)) == 3


# -- the tiny model across engine starts (issue: contracts/tiny model) -------------------------


def test_tiny_model_greedy_is_identical_across_engine_starts(
    tiny_model_dir: Path, greedy_reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    sampling = {
        "temperature": 0.0,
        "max_tokens": REFERENCE_MAX_TOKENS,
        "logprobs": 0,
        "ignore_eos": True,
    }
    second_start = offline_reference(tiny_model_dir, REFERENCE_PROMPTS, sampling, tmp_path)
    assert [r["token_ids"] for r in second_start] == [r["token_ids"] for r in greedy_reference]
    assert all(len(r["token_ids"]) == REFERENCE_MAX_TOKENS for r in second_start)


async def test_routed_experts_asked_of_a_server_that_does_not_capture_them_are_refused(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    """A request for its routed experts on a server started without
    --enable-return-routed-experts: FAILED_PRECONDITION naming the flag, before the engine
    sees it (not an answer that silently lacks them); the server goes on serving."""
    asked = SP(temperature=0.0, max_tokens=2, return_routed_experts=True)
    request = data_plane_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=asked)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await data.Generate(request)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-return-routed-experts" in (refused.value.details() or "")
    assert len(await greedy(data, [1, 2, 3], 2)) == 2


async def test_a_continuation_newer_than_the_served_weights_is_refused_naming_both(
    data: data_plane_pb2_grpc.DataPlaneAsyncStub,
) -> None:
    """A continuation of tokens made at a weight version this server does not have yet
    (``min_weight_version``): FAILED_PRECONDITION naming both versions, before the engine sees
    it, so a sample's versions never go backwards; at its own version it runs."""
    first = [c async for c in data.GenerateStream(_floor_request(0))]
    serving = first[0].weight_version
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in data.GenerateStream(_floor_request(serving + 1)):
            pass
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert f"serves weight version {serving}" in details
    assert f"min_weight_version {serving + 1}" in details
    tokens = [t async for c in data.GenerateStream(_floor_request(serving)) for t in c.token_ids]
    assert len(tokens) == 2


def _floor_request(min_weight_version: int) -> data_plane_pb2.GenerateStreamRequest:
    return data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=[1, 2, 3],
        sampling_params=SP(temperature=0.0, max_tokens=2),
        min_weight_version=min_weight_version,
    )
