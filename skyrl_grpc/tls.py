"""TLS settings of a client channel (the trainer client's, and the router's to its backends)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    """TLS for every channel. Paths are read when a channel opens (in the process using it)."""

    root_certificates: str | None = None  # CA bundle to verify servers; None: system roots
    client_certificate: str | None = None  # for mutual TLS
    client_key: str | None = None
    server_name_override: str | None = None  # when certificates name a host other than the address

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.root_certificates),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_certificate),
        )
