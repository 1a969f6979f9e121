"""What every testbed job shares: its progress lines and its client's settings."""

from __future__ import annotations

from typing import Any


def progress(what: str) -> None:
    print(f"PROGRESS {what}", flush=True)


def client_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """``InferenceClient`` keyword arguments of a job's ``client`` (its ``tls`` made a
    ``TlsConfig``)."""
    from skyrl_grpc.tls import TlsConfig

    settings = dict(arguments.get("client", {}))
    if "tls" in settings:
        settings["tls"] = TlsConfig(**settings["tls"])
    return settings
