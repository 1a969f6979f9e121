"""What every process entry point shares: gRPC server options, logging setup and the JSON
lifecycle lines on stdout. Kept free of vLLM imports so the router starts fast."""

from __future__ import annotations

import json
import logging
import sys


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def announce(event: str, **fields: object) -> None:
    """One JSON line on stdout per lifecycle event (listening, ready, stopped), for launchers
    and tests to read."""
    print(json.dumps({"event": event, **fields}), flush=True)


def grpc_server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A port already in use must fail loudly rather than be shared with another process.
        ("grpc.so_reuseport", 0),
        # Long generations keep streams idle between tokens only briefly, but a paused server
        # can hold streams for minutes: ping so dead peers are noticed and proxies keep them.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
