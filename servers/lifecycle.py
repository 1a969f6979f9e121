"""What every process entry point shares: gRPC server options, logging setup and the JSON
lifecycle lines on stdout. Kept free of vLLM imports so the router starts fast."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc


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


def add_tls_arguments(parser: object) -> None:
    group = parser.add_argument_group("TLS")  # type: ignore[attr-defined]
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve with TLS")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca", default=None, help="PEM CA: require client certificates (mTLS)"
    )


def tls_from_args(args: object) -> ServerTls | None:
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return ServerTls(cert, key, getattr(args, "tls_client_ca", None))
