"""What every process entry point shares: logging setup and the JSON lifecycle lines on stdout."""

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
