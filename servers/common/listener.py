"""How a server process listens: gRPC server options from one message-size setting, TLS
credentials and their flags, and binding the port. Free of vLLM imports (the router uses it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from skyrl_grpc.channels import DEFAULT_MAX_MESSAGE_BYTES, MiB

ServerOption = tuple[str, int | str]


#: How much larger than --max-message-mib a message gRPC itself still reads: the servers'
#: interceptor refuses it then, naming the flag (gRPC's own refusal, for anything larger, does
#: not).
RECEIVE_HEADROOM = 2


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    receive_headroom: int = 1,
    reuse_port: bool = False,
) -> list[ServerOption]:
    """Options of every gRPC server of the stack (engine servers and the router).
    ``receive_headroom``: gRPC reads messages up to this many times ``max_message_bytes``, for
    a server whose interceptor refuses what is over it by name (``RECEIVE_HEADROOM``).
    ``reuse_port``: the port is shared with other processes that ask for it too (router
    replicas: the kernel spreads connections among them)."""
    return [
        # Up to the headroom a message is read and refused by the error interceptor with a
        # message naming --max-message-mib; anything larger gRPC refuses with
        # RESOURCE_EXHAUSTED before it is read whole.
        ("grpc.max_receive_message_length", receive_headroom * max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A port already in use must fail loudly rather than be shared with another process,
        # unless sharing it is the point.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        # A paused server can hold streams for minutes: ping so dead peers are noticed and
        # proxies keep the connection.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Accept the keepalive pings of clients (every 10 s) and routers (every second by
        # default: skyrl_grpc.channels.liveness_options) with margin, even on an idle
        # connection, instead of answering them with GOAWAY "too many pings".
        ("grpc.http2.min_ping_interval_without_data_ms", 250),
    ]


def add_message_size_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-message-mib",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES // MiB,
        help="largest message accepted or sent, in MiB (larger ones: RESOURCE_EXHAUSTED)",
    )


@dataclass(frozen=True)
class ServerTls:
    """TLS for a listening port; with ``client_ca`` clients must present a certificate it signed
    (mutual TLS)."""

    certificate: str  # PEM file: the server's certificate chain
    key: str  # PEM file: its private key
    client_ca: str | None = None  # PEM file: CA that signs client certificates (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.certificate).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


def bind(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Adds the listening port (TLS when configured); returns the bound port or raises."""
    port = (
        server.add_secure_port(address, tls.credentials())
        if tls is not None
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS")
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve with TLS")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca", default=None, help="PEM CA: require client certificates (mTLS)"
    )


def tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    cert, key = args.tls_cert, args.tls_key
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return ServerTls(cert, key, args.tls_client_ca)
