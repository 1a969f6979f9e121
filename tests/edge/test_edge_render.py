"""The HTTP edge's answers built from the contract's samples (pure: no server)."""

from __future__ import annotations

from typing import Any

import pytest

from servers.router.http_edge import parse, render
from skyrl_grpc.v1 import data_plane_pb2, lora_pb2
from skyrl_grpc.v1 import generation_pb2 as gen


def _call(chat: bool, **body: object) -> parse.GenerationCall:
    base: dict[str, object] = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1, 2]}
    )
    return parse.read_generation({**base, **body}, chat=chat)


def test_a_whole_sample_reads_as_vllm_reports_it() -> None:
    call = _call(False, stop=["END"], include_stop_str_in_output=True, return_token_ids=True)
    sample = gen.Sample(
        index=1,
        token_ids=[5, 6],
        text="ab",
        finish_reason=gen.FINISH_REASON_STOP,
        stop=gen.StopMatch(text="END"),
    )
    out = render.sample_out(sample, call, index_offset=2)
    assert (out.index, out.text, out.finish_reason, out.stop_reason) == (3, "abEND", "stop", "END")
    choice = render.choice(call, out, [], prompt=[1, 2])
    assert choice["token_ids"] == [5, 6] and choice["prompt_token_ids"] == [1, 2]
    assert choice["logprobs"] is None


def test_chat_answers_and_chunks_have_openais_shapes() -> None:
    call = _call(True, return_token_ids=True)
    out = render.SampleOut(0, [7], "hello", "length")
    whole = render.response(call, [render.choice(call, out, [], [1])], render.usage(1, 1, 0), [1])
    assert whole["object"] == "chat.completion" and whole["prompt_token_ids"] == [1]
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }  # as vLLM's server writes it: no calls, no tool_calls key
    # A choice opens with its role (as vLLM's server streams it), the prompt's ids on that event.
    opening = render.role_chunk(call, 0, [1])
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening["prompt_token_ids"] == [1]
    piece = render.chunk_choice(call, 0, "he", [7], None, None, None, [], delta={"content": "he"})
    assert piece["delta"] == {"content": "he"} and "stop_reason" not in piece
    last = render.chunk_choice(call, 0, "", [], "stop", 9, None, [])
    assert last["finish_reason"] == "stop" and last["stop_reason"] == 9
    assert render.chunk(call, [last])["object"] == "chat.completion.chunk"


def test_models_lists_the_base_then_its_adapters() -> None:
    info = data_plane_pb2.GetModelInfoResponse(
        served_model_name="base",
        max_context_length=512,
        lora_adapters=[lora_pb2.LoraAdapter(name="policy", version=3)],
    )
    listed = render.models(info, created=0)["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [("base", None), ("policy", "base")]
    assert listed[1]["lora_version"] == 3 and listed[0]["max_model_len"] == 512


def test_a_required_choice_answered_without_a_call_does_not_say_tool_calls() -> None:
    """vLLM's server says "tool_calls" for any required answer that stopped by itself; the edge
    says it only where the answer has calls (the engine hands back text when it found none)."""
    from servers.router.http_edge import tool_calls
    from skyrl_grpc.v1 import chat_tools_pb2 as tools_pb2

    use = tools_pb2.ToolUse(
        tools=[tools_pb2.Tool(name="f")],
        tool_choice=tools_pb2.ToolChoice(mode=tools_pb2.TOOL_CHOICE_MODE_REQUIRED),
    )
    text_only = tools_pb2.ChatMessageOut(content="[{")
    called = tools_pb2.ChatMessageOut(
        tool_calls=[tools_pb2.ToolCall(id="c", name="f", arguments_json="{}")]
    )
    assert tool_calls.whole_finish_reason(use, text_only, "stop") == "stop"
    assert tool_calls.whole_finish_reason(use, called, "stop") == "tool_calls"
    assert tool_calls.whole_finish_reason(use, called, "length") == "length"


def _steps(chat: bool) -> list[data_plane_pb2.GenerateStreamResponse]:
    """A stream of two samples' steps as the engine sends them: the first with the prompt's
    cached tokens, middle steps of text (chat: parsed deltas), one held back by the chat
    parser, the finishes."""
    steps = []
    for index in (0, 1):
        for position, text in enumerate(["Hel", "lo \u00e9", ' "q"\n', ""]):
            step = data_plane_pb2.GenerateStreamResponse(
                sample_index=index,
                token_ids=[10 + position, 20 + position] if text else [30],
                text=text,
                usage=gen.Usage(prompt_tokens=2, completion_tokens=2 * (position + 1)),
            )
            if chat and text:
                step.chat_delta.content = text
            if not text:
                step.finish_reason = gen.FINISH_REASON_STOP
            steps.append(step)
        held = data_plane_pb2.GenerateStreamResponse(sample_index=index, token_ids=[99])
        steps.insert(2, held)  # no text, no delta: the chat parser holds it back
    return steps


def test_each_streamed_step_is_the_same_event_as_one_built_from_dicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import orjson

    from servers.router.http_edge.stream_events import DONE, StreamedAnswer

    built = [0]  # choices built from dicts
    chunk_choice = render.chunk_choice

    def counted(*args: Any, **kwargs: Any) -> Any:
        built[0] += 1
        return chunk_choice(*args, **kwargs)

    monkeypatch.setattr(render, "chunk_choice", counted)  # the module stream_events calls
    for chat in (False, True):
        for asked in ({}, {"return_token_ids": True}, {"stream_options": {"include_usage": True}}):
            call = _call(chat, stream=True, n=2, **asked)
            fast, reference = StreamedAnswer(call), StreamedAnswer(call)
            reference.always_dicts = True
            written, expected, fast_built = [], [], 0
            for step in _steps(chat):
                built[0] = 0
                written.append(fast.step(gen_copy(step), 0, [1, 2]))
                fast_built += built[0]
                expected.append(reference.step(gen_copy(step), 0, [1, 2]))
            # The same events, byte for byte (and so the same JSON, with vLLM's keys).
            assert written == expected, (chat, asked)
            events = [e for data in written for e in data.split(b"\n\n") if e]
            assert all(orjson.loads(e.removeprefix(b"data: ")) for e in events)
            # Most of the fast answer's steps did not build dicts: this compared something.
            assert fast_built <= len(events) / 2, (chat, asked, fast_built, len(events))
            assert fast.end() == reference.end() and fast.end().endswith(DONE)
            if asked.get("stream_options"):
                usage = orjson.loads(fast.end().split(b"\n\n")[0].removeprefix(b"data: "))
                assert usage["usage"]["completion_tokens"] == 8  # the request's last usage


def gen_copy(
    step: data_plane_pb2.GenerateStreamResponse,
) -> data_plane_pb2.GenerateStreamResponse:
    copied = data_plane_pb2.GenerateStreamResponse()
    copied.CopyFrom(step)
    return copied


def test_a_whole_answers_routed_experts_go_in_vllms_field_of_completions_and_chat() -> None:
    from skyrl_grpc import routed_experts

    experts = routed_experts.pack([[[1, 2]], [[3, 0]]])  # 2 tokens, 1 layer, top-2
    sample = gen.Sample(index=0, token_ids=[5, 6, 7], finish_reason=gen.FINISH_REASON_LENGTH)
    sample.routed_experts.CopyFrom(experts)
    for chat in (False, True):
        call = _call(chat)
        out = render.sample_out(sample, call)
        assert out.routed_experts == routed_experts.npy_base64(experts)
        assert render.choice(call, out, [], [1])["routed_experts"] == out.routed_experts
    without = render.sample_out(gen.Sample(index=0, token_ids=[5]), _call(False))
    assert render.choice(_call(False), without, [], [1])["routed_experts"] is None
