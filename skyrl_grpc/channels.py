"""Opening a channel to a server: one builder for the trainer client and the router.

Both talk to engine servers over long-lived channels; they share the message size limit the
servers were started with, the keepalive that notices a silently dead peer, and TLS.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from skyrl_grpc.tls import TlsConfig

MiB = 1 << 20
#: The message size limit servers, the router and clients use unless told otherwise: large
#: enough for a weight chunk or a long prompt, small enough to refuse a runaway message early.
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB

ChannelOption = tuple[str, int | str]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[ChannelOption]:
    """Options of every channel to a server or router."""
    return [
        # Messages can be as large as the servers accept (weight chunks, long prompts).
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Notice a silently dead peer (no RST: a killed VM, a cut network) within seconds
        # instead of a TCP timeout; servers permit pings without calls at this rate.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly once a restarted server listens again.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def liveness_options(seconds: float) -> list[ChannelOption]:
    """Channel options that lose a peer answering no keepalive ping within ``seconds`` (a ping
    every half of it, another half to answer), so the calls on a silently dead connection fail
    UNAVAILABLE then instead of after TCP's minutes: the router's to its servers, whose streams
    then migrate. Servers accept pings this often (``servers.common.listener``)."""
    half = max(round(seconds * 500), 100)
    return [
        ("grpc.keepalive_time_ms", half),
        ("grpc.keepalive_timeout_ms", half),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def prompt_reconnect_options(seconds: float) -> list[ChannelOption]:
    """Channel options that reconnect within about ``seconds`` of a partition's heal: a
    connection attempt no answer reaches is given up after half of it (gRPC's least connect
    timeout, 20 s by default, would leave it to the kernel's SYN retries: 1, 2, 4, 8 s apart),
    and the next one starts at most half of it later (never later than every channel's 2 s:
    a long liveness must not slow the reconnection to a restarted server). The router's to its
    servers, whose health it watches again as soon as they reconnect."""
    half = max(round(seconds * 500), 100)
    return [
        ("grpc.min_reconnect_backoff_ms", min(half, 20_000)),
        ("grpc.max_reconnect_backoff_ms", min(half, 2_000)),
    ]


def open_channel(
    address: str,
    *,
    tls: TlsConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[ChannelOption] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: plain, or TLS (mutual when ``tls`` has a client
    certificate). Certificate files are read here, in the process that uses the channel."""
    # Later options win: extra keepalive settings replace the defaults.
    options = list(
        {
            name: value for name, value in [*channel_options(max_message_bytes), *extra_options]
        }.items()
    )
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
