"""Parsers of command-line flag values that several commands share (argparse ``type=``)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def json_object(text: str) -> dict[str, Any]:
    """A flag's value as a JSON object (argparse names the flag when this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value
