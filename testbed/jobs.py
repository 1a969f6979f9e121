"""Workloads that run on a testbed host, as a trainer or a client on a machine of its own runs
them: ``python -m testbed.jobs JOB '<JSON arguments>'`` inside the host's namespace
(``testbed.stack.run_job``). Each prints lines as it goes (``PROGRESS <what>``) and ends with
one ``JOB-RESULT <JSON>`` line.

- ``update``: weight updates from the trainer's host, each step timed from the call until every
  server committed (``seconds``; ``began`` and ``ended`` on the monotonic clock; ``steps``:
  ``{"edit": k, "delta": bool}``: the model's checkpoint with the ``k``-th edit, an RL step's
  worth of changed elements each; ``{"edit": 0}`` is the checkpoint itself), after each, each
  server's weight checksums beside the pushed tensors' (unless ``checksums`` is false); with
  ``save``, the last weights written as a model directory a fresh server can start from. A
  step's ``update``: more ``update_weights`` arguments; its ``retry_seconds``: tried again every
  second while it fails, this long; its ``pause``: the servers paused (abort) before the
  update and resumed after it, as a trainer's step does; its ``wait_for``: a file the step
  waits for before it begins (the caller's cue); its ``checksums``: false skips them after it
  (a server cut off would not answer); ``keep_going``: the next step follows a failed one.
- ``rl``: a trainer's RL loop pushing its weights every step for ``seconds``, retrying what
  faults fail (``testbed.rl_job``).
- ``checksums``: each server's weight checksums and versions.
- ``info``: each server's weight version, or the error a call to it met (``tls``: a CA to
  verify the servers with).
- ``prompt_ids``: text prompts' ids as an OpenAI edge (``edge``: its base URL) tokenizes them
  (``prompt_token_ids`` of a completion) beside a server's Tokenize (``server``).
- ``streams``: ``streams`` greedy GenerateStream calls of ``tokens`` tokens each through
  ``address`` (a router), each with a session of its own, started again as each ends, for
  ``seconds``; prints ``PROGRESS streaming`` once every stream has its first token; returns
  the calls as a ``testbed.history.History`` (``expected``: the undisturbed answer, checked
  against each call; ``deadline``: each call's, seconds; a call that ends with a status its
  client retries is sent again, the same request, as a client does: ``RETRIES``) and each
  call's longest wait between two of its messages (``max_gaps``); sessions are named
  ``<prefix>-<i>`` (``prefix``, default ``stream``).
- ``generations``: ``streams`` through the trainer client's ``generate``, straight to the
  servers (the direct path), each call recorded whole.
- ``edge``: ``streams`` through an OpenAI edge (``address``: its base URL), streamed
  completions read as an agent harness reads them (sessions ``<prefix>-<i>``, default ``edge``).

A job's ``client`` settings are ``InferenceClient``'s (``ClientConfig``), ``tls`` given as
``TlsConfig``'s fields (``{"root_certificates": <a CA's path>, ...}``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from testbed import rl_job, weight_jobs
from testbed.job_io import client_settings, progress

JOB_RESULT = "JOB-RESULT "
# The prompt of every greedy stream the jobs make (``streams``, ``generations``).
STREAM_PROMPT = [1, 45, 722, 84]
# A request that ends with a status its client retries (testbed.history.RETRYABLE) is sent
# again, as a client does: after 0.25 s, doubling up to 2 s, at most RETRIES times.
RETRIES = 12
RETRY_FIRST_SECONDS = 0.25
# The gRPC status an OpenAI edge's HTTP status stands for (testbed.history's vocabulary).
HTTP_STATUS_NAMES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def http_status_name(code: int) -> str:
    return HTTP_STATUS_NAMES.get(code, f"HTTP {code}")


# Makes one attempt at a session's request: fills the record (a ``testbed.history.Call``) and
# sets the event at the session's first message; returns the longest wait between messages.
Attempt = Callable[[Any, str, asyncio.Event], Awaitable[float]]


async def streaming_sessions(
    arguments: dict[str, Any], prefix: str, attempt: Attempt
) -> dict[str, Any]:
    """``streams`` sessions (``<prefix>-<i>``, ``prefix`` from the arguments or this default),
    each making its requests one after another for ``seconds``, every attempt recorded as a
    ``testbed.history.Call``; an attempt that ends with a status its client retries is made
    again, the same request (``RETRIES``), and each session makes at least one request however
    late it starts. Prints ``PROGRESS streaming`` once every session has its first message (or
    a first attempt that failed); returns the history and each attempt's longest gap."""
    from testbed.history import RETRYABLE, Call, History

    history, gaps = History(), []
    started = [asyncio.Event() for _ in range(arguments["streams"])]
    until = time.monotonic() + arguments["seconds"]

    async def requests(index: int) -> None:
        session = f"{arguments.get('prefix', prefix)}-{index}"
        turn, retries = 0, 0
        while turn == 0 or retries or time.monotonic() < until:
            record = Call(
                key=f"{session}/{turn}",
                started=time.monotonic(),
                ended=0.0,
                deadline=float(arguments.get("deadline", 120)),
                session=session,
                expected=arguments.get("expected"),
            )
            try:
                gaps.append(await attempt(record, session, started[index]))
            finally:
                started[index].set()  # a request that failed first still lets the job go on
            record.ended = time.monotonic()
            history.calls.append(record)
            if record.status in RETRYABLE and retries < RETRIES:
                retries += 1  # the same request again, as its client retries it
                await asyncio.sleep(min(RETRY_FIRST_SECONDS * 2 ** (retries - 1), 2.0))
            else:
                turn, retries = turn + 1, 0

    running = asyncio.gather(*(requests(i) for i in range(len(started))))
    await asyncio.gather(*(event.wait() for event in started))
    progress("streaming")
    await running
    return {"history": history.to_json(), "max_gaps": gaps}


async def info(arguments: dict[str, Any]) -> dict[str, Any]:
    from trainer_client import InferenceClient, InferenceError

    found: dict[str, Any] = {}
    for address in arguments["servers"]:
        client = InferenceClient(address, [address], direct=False, **client_settings(arguments))
        try:
            found[address] = {"version": (await client.weight_versions())[address]}
        except InferenceError as error:
            found[address] = {"error": str(error)}
        finally:
            await client.close()
    return found


async def prompt_ids(arguments: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from trainer_client import InferenceClient

    server = InferenceClient(arguments["server"])
    edge, served = [], []
    async with httpx.AsyncClient(base_url=arguments["edge"], timeout=120) as http:
        for text in arguments["texts"]:
            body = {"model": "", "prompt": text, "max_tokens": 1, "return_token_ids": True}
            answer = (await http.post("/v1/completions", json=body)).json()
            edge.append(answer["choices"][0]["prompt_token_ids"])
            served.append(await server.tokenize(text))
    await server.close()
    return {"edge": edge, "server": served}


async def streams(arguments: dict[str, Any]) -> dict[str, Any]:
    import grpc

    from skyrl_grpc.metadata import ROUTED_TO, SESSION_ID
    from skyrl_grpc.v1 import data_plane_pb2, data_plane_pb2_grpc
    from skyrl_grpc.v1 import generation_pb2 as gen
    from testbed.history import Call, Message

    deadline_seconds = float(arguments.get("deadline", 120))
    request = data_plane_pb2.GenerateStreamRequest(
        prompt_token_ids=STREAM_PROMPT,
        sampling_params=gen.SamplingParams(
            temperature=0.0, max_tokens=arguments["tokens"], ignore_eos=True
        ),
    )
    async with grpc.aio.insecure_channel(arguments["address"]) as channel:
        stub = data_plane_pb2_grpc.DataPlaneStub(channel)

        async def attempt(record: Call, session: str, first: asyncio.Event) -> float:
            gap, last = 0.0, time.monotonic()
            call = stub.GenerateStream(
                request, metadata=((SESSION_ID, session),), timeout=deadline_seconds
            )
            try:
                async for chunk in call:
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    record.answered = record.answered or now
                    record.messages.append(
                        Message(
                            list(chunk.token_ids),
                            chunk.usage.completion_tokens,
                            chunk.weight_version,
                        )
                    )
                    if chunk.finish_reason:
                        record.finish_reason = gen.FinishReason.Name(chunk.finish_reason)
                    first.set()
                routed = dict(await call.initial_metadata() or ())
                record.server = str(routed.get(ROUTED_TO, ""))
            except grpc.aio.AioRpcError as failed:
                record.status = failed.code().name
            return gap

        return await streaming_sessions(arguments, "stream", attempt)


async def generations(arguments: dict[str, Any]) -> dict[str, Any]:
    """``streams`` as a trainer makes them: ``InferenceClient.generate`` from this host, each
    call straight to the server the router's policy picks (``router``; ``servers``: the
    fleet), the client moving a generation on with its tokens so far when its server is lost.
    Each call is recorded whole (one message: its tokens, their count, the last token's weight
    version; a failure as its status); ``max_gaps`` holds each call's duration. Sessions are
    ``<prefix>-<i>`` (default ``generate``); ``sessions`` false sends none (each call goes to
    the server with the least in flight)."""
    from testbed.history import Call, Message
    from trainer_client import InferenceClient, ServerError

    client = InferenceClient(
        arguments["router"], arguments["servers"], **client_settings(arguments)
    )
    sampling = {"temperature": 0.0, "max_tokens": arguments["tokens"], "ignore_eos": True}

    async def attempt(record: Call, session: str, first: asyncio.Event) -> float:
        try:
            session_id = session if arguments.get("sessions", True) else None
            result = await client.generate(
                STREAM_PROMPT, sampling, session_id=session_id, timeout=record.deadline
            )
        except ServerError as failed:
            record.status = failed.code.name
        else:
            spans = result.weight_versions
            version = spans[-1].weight_version if spans else 0
            record.messages.append(Message(result.token_ids, len(result.token_ids), version))
            record.finish_reason = str(result.finish_reason)
        first.set()
        return time.monotonic() - record.started

    try:
        return await streaming_sessions(arguments, "generate", attempt)
    finally:
        await client.close()


async def edge(arguments: dict[str, Any]) -> dict[str, Any]:
    """``streams`` through an OpenAI edge (``address``: its base URL) as an agent harness
    calls it: streamed completions of the same greedy request, each with a session of its own
    (``x-session-id``), the tokens read from vLLM's ``token_ids`` field of each event and the
    count from the final usage."""
    import httpx

    from skyrl_grpc.metadata import SESSION_ID
    from testbed.history import Call, Message

    deadline_seconds = float(arguments.get("deadline", 120))
    async with httpx.AsyncClient(base_url=arguments["address"], timeout=deadline_seconds) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": [1, 45, 722, 84],
            "max_tokens": arguments["tokens"],
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

        async def attempt(record: Call, session: str, first: asyncio.Event) -> float:
            gap, last, received, answered = 0.0, time.monotonic(), 0, False
            try:
                async with http.stream(
                    "POST", "/v1/completions", json=body, headers={SESSION_ID: session}
                ) as response:
                    answered = True
                    if response.status_code != 200:
                        record.status = http_status_name(response.status_code)
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.monotonic()
                        gap, last = max(gap, now - last), now
                        event = json.loads(line[len("data: ") :])
                        if "error" in event:  # the edge's end of a stream that failed
                            record.status = http_status_name(int(event["error"]["code"]))
                        for choice in event.get("choices", []):
                            ids = list(choice.get("token_ids") or [])
                            received += len(ids)
                            record.messages.append(Message(ids, received))
                            if choice.get("finish_reason"):
                                record.finish_reason = str(choice["finish_reason"]).upper()
                        usage = event.get("usage")
                        if usage and usage["completion_tokens"] != received:
                            # The server's count against the tokens that came: lost or
                            # repeated ones show as a message whose count is off.
                            record.messages.append(Message([], usage["completion_tokens"]))
                        first.set()
            except httpx.TransportError as failed:
                # No answer at all (a kept-alive connection the edge closed as the request
                # went out, one refused): what the OpenAI SDK retries (APIConnectionError), as
                # UNAVAILABLE; a stream cut after its answer began is not retried.
                retried = not answered
                record.status = "UNAVAILABLE" if retried else f"{type(failed).__name__}: {failed}"
            except httpx.HTTPError as failed:
                record.status = f"{type(failed).__name__}: {failed}"
            return gap

        return await streaming_sessions(arguments, "edge", attempt)


JOBS = {
    "rl": rl_job.rl,
    "edge": edge,
    "update": weight_jobs.update,
    "checksums": weight_jobs.checksums,
    "info": info,
    "prompt_ids": prompt_ids,
    "streams": streams,
    "generations": generations,
}


def main() -> None:
    job, arguments = sys.argv[1], json.loads(sys.argv[2])
    result = asyncio.run(JOBS[job](arguments))
    print(JOB_RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
