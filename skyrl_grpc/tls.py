"""TLS settings of a client channel (the trainer client's, and the router's to its backends)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

#: A certificate or key: PEM bytes (gRPC's own convention), or the path of a PEM file.
PemSource = bytes | str | Path

PEM_MARKER = b"-----BEGIN "


@dataclass(frozen=True)
class TlsConfig:
    """TLS for every channel. Each certificate or key is PEM bytes (as
    ``grpc.ssl_channel_credentials`` takes them) or the path of a PEM file, read when a channel
    opens, in the process using it. Checked when made: bytes that are not PEM, a path that is
    not a file, or a client certificate without its key (or the reverse) is a ``ValueError``
    naming the field, not a ``TypeError`` at the first call."""

    root_certificates: PemSource | None = None  # CA bundle to verify servers; None: system roots
    client_certificate: PemSource | None = None  # for mutual TLS
    client_key: PemSource | None = None
    server_name_override: str | None = None  # when certificates name a host other than the address

    def __post_init__(self) -> None:
        for field in ("root_certificates", "client_certificate", "client_key"):
            _check(field, getattr(self, field))
        if (self.client_certificate is None) != (self.client_key is None):
            raise ValueError(
                "TlsConfig: client_certificate and client_key go together (mutual TLS needs both)"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_certificates),
            private_key=_read(self.client_key),
            certificate_chain=_read(self.client_certificate),
        )


def _check(field: str, source: PemSource | None) -> None:
    if source is None:
        return
    if isinstance(source, bytes):
        if PEM_MARKER not in source:
            raise ValueError(
                f"TlsConfig.{field}: bytes that are not PEM (no '-----BEGIN ' line); pass the "
                "PEM file's contents, or its path as a str"
            )
        return
    if not isinstance(source, str | Path):
        raise ValueError(
            f"TlsConfig.{field}: {type(source).__name__}; pass PEM bytes or a file path"
        )
    if not Path(source).is_file():
        raise ValueError(f"TlsConfig.{field}: {str(source)!r} is not a file")


def _read(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()
