"""Request migration: a generation cut by a dying server continues on a healthy one.

The router forwards raw bytes, except for GenerateStream calls it may migrate: it reads each
chunk (without changing it) to remember the tokens generated so far (the HTTP edge's chunks
arrive parsed, and are read as they are). When the backend is lost
mid-stream, ``StreamMigration`` builds the continuation request (prompt + tokens so far, with the
remaining budget and its tokens' weight version: ``skyrl_grpc.continuation``) for another
backend at that version or newer, and rewrites the
continuation's chunks so the caller sees one uninterrupted stream (usage counted from the
original prompt). Only single-sample streams migrate, and constrained ones only before their
first token; others fail UNAVAILABLE naming the lost server. A server cut off rather than dead
may still run the request it lost (``orphaned_on``); ``abort_orphan`` ends it there.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

import grpc

from servers.router.upstreams import Metadata
from skyrl_grpc.continuation import continue_request, resumable
from skyrl_grpc.names import ABORT, GENERATE_STREAM
from skyrl_grpc.v1 import data_plane_pb2

log = logging.getLogger(__name__)


class StreamMigration:
    """Tracks one GenerateStream call so it can be resubmitted elsewhere."""

    def __init__(self, request: data_plane_pb2.GenerateStreamRequest, max_migrations: int) -> None:
        self._request = request
        self._prompt_tokens = len(request.prompt_token_ids)
        self.max_migrations = max_migrations
        # Chunks before the first migration are kept as they came (bytes, or parsed for the
        # HTTP edge) and read only if one happens: the hot path (no failure) pays one list
        # append per chunk.
        self._unread: list[bytes | data_plane_pb2.GenerateStreamResponse] = []
        self._tokens: list[int] = []
        self._experts_rows = 0  # rows of routed experts forwarded (a continuation's start)
        # The newest weight version of its tokens (or the caller's own floor): where it may go.
        self._version = request.min_weight_version
        self.lost: list[str] = []
        # Servers lost before they answered it (the router then tried it again, unchanged).
        self._unanswered_on: set[str] = set()
        self._finished = False

    def _parse_backlog(self) -> None:
        for chunk in self._unread:
            if isinstance(chunk, bytes):
                chunk = data_plane_pb2.GenerateStreamResponse.FromString(chunk)
            self._read(chunk)
        self._unread.clear()

    def _read(self, chunk: data_plane_pb2.GenerateStreamResponse) -> None:
        self._tokens.extend(chunk.token_ids)
        self._experts_rows += chunk.routed_experts.tokens
        self._finished = self._finished or bool(chunk.finish_reason)
        if chunk.token_ids:
            self._version = max(self._version, chunk.weight_version)

    @property
    def tokens(self) -> list[int]:
        self._parse_backlog()
        return self._tokens

    @property
    def min_version(self) -> int:
        """The oldest weights it may go on with: its tokens' newest version (a backend older
        than that would turn its versions backwards)."""
        self._parse_backlog()
        return self._version

    @property
    def finished(self) -> bool:
        self._parse_backlog()
        return self._finished

    @classmethod
    def for_call(
        cls,
        method: str,
        request: bytes | data_plane_pb2.GenerateStreamRequest,
        max_migrations: int,
    ) -> StreamMigration | None:
        if method != GENERATE_STREAM or max_migrations <= 0:
            return None
        if isinstance(request, data_plane_pb2.GenerateStreamRequest):
            parsed = request
        else:
            try:
                parsed = data_plane_pb2.GenerateStreamRequest.FromString(request)
            except Exception:
                return None  # the backend will answer INVALID_ARGUMENT; nothing to migrate
        return cls(parsed, max_migrations) if parsed.n <= 1 else None

    def observe(self, message: Any) -> Any:
        """Records a chunk (its bytes, or the chunk parsed); returns what to send the caller,
        in the same form (rewritten after a migration)."""
        if not self.lost:
            self._unread.append(message)
            return message
        if isinstance(message, bytes):
            return self._rewrite(data_plane_pb2.GenerateStreamResponse.FromString(message))
        return self._rewrite(message, serialize=False)

    def _rewrite(self, chunk: data_plane_pb2.GenerateStreamResponse, serialize: bool = True) -> Any:
        """A continuation's chunk as the caller's stream goes on (its bytes, or itself)."""
        generated_before = len(self._tokens)
        self._read(chunk)
        chunk.request_id = self._request.request_id or chunk.request_id
        chunk.usage.prompt_tokens = self._prompt_tokens
        chunk.usage.completion_tokens = generated_before + len(chunk.token_ids)
        chunk.ClearField("prompt_logprobs")  # the continuation's "prompt" includes our tokens
        return chunk.SerializeToString() if serialize else chunk

    def can_migrate(self) -> bool:
        """Not finished, migrations left, and either nothing sent yet (a plain retry) or an
        output that can continue where it was cut (``resumable``: a constrained one cannot,
        and the caller has its first tokens)."""
        if self.finished or len(self.lost) >= self.max_migrations:
            return False
        return resumable(self._request) or not self.tokens

    def lost_unanswered(self, address: str) -> None:
        """``address`` was lost before it answered the request (which is then tried again)."""
        self._unanswered_on.add(address)

    def orphaned_on(self, address: str) -> str | None:
        """The request's id where the stream was lost from ``address`` (mid-stream, or before
        its first message) and the id is the caller's: a server that was cut off rather than
        dead may still run it (it has not seen the stream end), and refuses the same id again
        ALREADY_EXISTS."""
        if address not in self.lost and address not in self._unanswered_on:
            return None
        return self._request.request_id or None

    def continuation(self, lost_backend: str) -> bytes:
        """The request for the next backend: prompt + tokens so far, the budget that is left."""
        self.lost.append(lost_backend)
        continued = continue_request(
            self._request, self.tokens, self.min_version, self._experts_rows
        )
        return continued.SerializeToString()


def floor_of(method: str, request: Any) -> int:
    """A GenerateStream request's ``min_weight_version`` (a continuation the caller made: it
    goes on no older weights, migration or not); 0 for any other call."""
    if method != GENERATE_STREAM:
        return 0
    if isinstance(request, data_plane_pb2.GenerateStreamRequest):
        return request.min_weight_version
    try:
        return data_plane_pb2.GenerateStreamRequest.FromString(request).min_weight_version
    except Exception:
        return 0  # the backend will answer INVALID_ARGUMENT


async def abort_orphan(channel: grpc.aio.Channel, request_id: str, metadata: Metadata) -> None:
    """Aborts ``request_id`` on the server of ``channel``, where a stream moved away from it
    left it running (best effort: the continuation's next try says whether it is gone)."""
    log.warning("request %s still runs where a stream moved from: aborting it there", request_id)
    call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(ABORT)
    abort = data_plane_pb2.AbortRequest(request_ids=[request_id])
    with suppress(grpc.aio.AioRpcError):
        await call(abort.SerializeToString(), timeout=5.0, metadata=metadata)
