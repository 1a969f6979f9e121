"""The HTTP edge's plumbing: an ASGI app that routes requests to handlers, reads bodies and
metadata, writes JSON and server-sent events, cancels a handler whose client went away, and
answers every error in OpenAI's shape (``http_status``); and the uvicorn server it runs on.

Served by uvicorn (httptools) in the router's event loop: measured against aiohttp's server on
64 concurrent SSE streams here, uvicorn carried 1.0-1.3x the events per second; a bare ASGI
callable (no framework) keeps the per-request cost to the JSON work itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, MutableMapping
from typing import Any

import grpc
import orjson
import uvicorn

from servers.common.grpc_types import Context
from servers.router.http_edge.http_status import error_body
from servers.router.inner_call import CallFailed, InnerCall
from skyrl_grpc import tracing
from skyrl_grpc.errors import InvalidArgument, SkyrlError
from skyrl_grpc.metadata import AUTHORIZATION, SESSION_ID

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Metadata = tuple[tuple[str, str], ...]
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Request:
    """One HTTP request as the handlers read it."""

    def __init__(self, body: Any, metadata: Metadata) -> None:
        self.body = body
        self.metadata = metadata

    def call(self) -> Context:
        return InnerCall(self.metadata).context()


class Responder:
    """Writes one HTTP response: a JSON body, or server-sent events."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.status = 0  # the answer's status code, once started (metrics)

    async def json(self, status: int, body: Any) -> None:
        self.started = True
        self.status = status
        payload = orjson.dumps(body)
        await self._send({"type": "http.response.start", "status": status, "headers": _JSON})
        self.finished = True
        await self._send({"type": "http.response.body", "body": payload})

    async def page(self, body: bytes, content_type: bytes) -> None:
        """A whole body of its own type (the fleet page's HTML)."""
        self.started = True
        self.status = 200
        headers = [(b"content-type", content_type), (b"cache-control", b"no-store")]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self.finished = True
        await self._send({"type": "http.response.body", "body": body})

    async def event(self, body: Any) -> None:
        await self.events(b"data: " + orjson.dumps(body) + b"\n\n")

    async def events(self, data: bytes) -> None:
        """Server-sent events, as their bytes (``stream_events``); the stream goes on."""
        if not self.started:
            self.started = True
            self.status = 200
            await self._send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def done(self, last: bytes = b"data: [DONE]\n\n") -> None:
        """Ends the stream with ``last`` (the events that end it, [DONE] the last of them)."""
        if not self.started:
            self.started = True
            self.status = 200
            await self._send({"type": "http.response.start", "status": 200, "headers": _SSE})
        self.finished = True
        await self._send({"type": "http.response.body", "body": last})


Handler = Callable[[Request, Responder], Awaitable[None]]
TRACE_CONTEXT = (tracing.TRACEPARENT, tracing.TRACESTATE)
# Called once per request with its route ('unmatched' for none), status code and seconds.
Observer = Callable[[str, int, float], None]


class AsgiApp:
    """Routes ``(method, path)`` to a handler; see the module docstring."""

    def __init__(
        self, routes: Mapping[tuple[str, str], Handler], observe: Observer | None = None
    ) -> None:
        self._routes = dict(routes)
        self._observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        responder = Responder(send)
        started = time.perf_counter()
        handler = self._routes.get((scope["method"], scope["path"]))
        route = scope["path"] if handler is not None else "unmatched"
        try:
            if tracing.enabled() and handler is not None:
                headers = [(k.decode("latin-1").lower(), v) for k, v in scope["headers"]]
                name = f"{scope['method']} {route}"
                with tracing.server_span(name, headers, {"http.route": route}) as span:
                    await self._serve(scope, receive, responder, handler)
                    span.set_attribute("http.response.status_code", responder.status)
            else:
                await self._serve(scope, receive, responder, handler)
        finally:
            if self._observe is not None:
                # 499 (nginx's): the client went away before an answer began.
                status = responder.status or 499
                self._observe(route, status, time.perf_counter() - started)

    async def _serve(
        self, scope: Scope, receive: Receive, responder: Responder, handler: Handler | None
    ) -> None:
        if handler is None:
            known = any(path == scope["path"] for _, path in self._routes)
            status = 405 if known else 404
            message = f"{scope['method']} {scope['path']}: no such route"
            await responder.json(status, error_body(grpc.StatusCode.NOT_FOUND, message)[1])
            return
        raw = await read_body(receive)
        work = asyncio.current_task()
        assert work is not None

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not responder.finished:
                work.cancel()  # the client went away: stop the work upstream

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            request = Request(None, ())
            try:
                body = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError as error:
                raise InvalidArgument(f"the request body is not valid JSON: {error}") from None
            request = Request(body, request_metadata(scope, body))
            await handler(request, responder)
        except asyncio.CancelledError:
            if not watcher.done():
                raise
            log.info("client disconnected from %s: call cancelled", scope["path"])
        except (CallFailed, SkyrlError) as error:
            code = error.code
            message = error.details if isinstance(error, CallFailed) else str(error)
            status, body = error_body(code, message)
            if not responder.started:
                await responder.json(status, body)
            elif not responder.finished:
                await responder.event(body)
                await responder.done()
        finally:
            watcher.cancel()


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def request_metadata(scope: Scope, body: Any) -> Metadata:
    """The gRPC metadata of an HTTP request: its bearer token and its session, from the
    ``X-Session-ID`` header or the ``session_id`` body field (removed from the body)."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    metadata: list[tuple[str, str]] = []
    if AUTHORIZATION in headers:
        metadata.append((AUTHORIZATION, headers[AUTHORIZATION]))
    session = headers.get(SESSION_ID)
    if isinstance(body, dict) and "session_id" in body:
        from_body = body.pop("session_id")
        session = session or (str(from_body) if from_body is not None else None)
    if session:
        metadata.append((SESSION_ID, session))
    # The caller's W3C trace context, passed on; with tracing on, the edge's own span's.
    metadata.extend((key, headers[key]) for key in TRACE_CONTEXT if key in headers)
    return tracing.with_context(tuple(metadata))


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpEdgeServer:
    """Serves an ASGI app on ``host:port`` (0: any free port) in the running loop."""

    def __init__(self, app: AsgiApp, host: str, port: int, reuse_port: bool = False) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # router replicas share the port: the kernel spreads connections
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        # Accepted connections inherit it: an event must not wait for the ACK of the one
        # before it (Nagle + delayed ACK cost ~40 ms before the first token).
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app, lifespan="off", http="httptools", log_level="warning", access_log=False
        )
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the HTTP edge stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
