"""Where vLLM's logs go, and what its engine process said before it died.

vLLM logs to stdout by default, where the engine server's lifecycle lines (JSON, one per event,
read by launchers) would drown in them. ``route_vllm_logs`` sends them to stderr instead, in
the server and in every process vLLM starts (through ``VLLM_LOGGING_CONFIG_PATH``, which the
children inherit), and copies every error record, with the exception it carries, to a small
file of JSON lines. When the engine process dies, all the server learns is "EngineDeadError:
see the stack trace above" - in another process's log. ``root_cause`` reads the file for the
exception that killed it, so the server can say what happened in its own error message.

Call ``route_vllm_logs`` before vLLM is imported (it configures logging at import).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

# vLLM's own format (vllm.logger), so the lines read as before, only on stderr.
_FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
    "[%(fileinfo)s:%(lineno)d] %(message)s"
)
# Exceptions that report a death rather than cause it.
_CONSEQUENCES = ("EngineDeadError", "EngineGenerateError")


class ErrorRecordFormatter(logging.Formatter):
    """One JSON line per error record: its message and the exception it carries."""

    def format(self, record: logging.LogRecord) -> str:
        exception = None
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            exception = f"{type(error).__name__}: {error}".strip()
        return json.dumps(
            {"process": os.getpid(), "message": record.getMessage(), "exception": exception}
        )


def route_vllm_logs(directory: Path | None = None) -> Path:
    """Sends vLLM's logs (this process's and its children's) to stderr and its error records
    to a file, whose path is returned."""
    directory = directory or Path(tempfile.mkdtemp(prefix="skyrl-engine-logs-"))
    errors = directory / "engine-errors.jsonl"
    errors.touch()
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": _FORMAT,
            },
            "errors": {"()": f"{__name__}.ErrorRecordFormatter"},
        },
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "stream": "ext://sys.stderr",
            },
            "errors": {
                "class": "logging.FileHandler",
                "formatter": "errors",
                "level": "ERROR",
                "filename": str(errors),
            },
        },
        "loggers": {"vllm": {"handlers": ["stderr", "errors"], "level": level, "propagate": False}},
    }
    path = directory / "vllm-logging.json"
    path.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    return errors


def root_cause(errors: Path | None) -> str | None:
    """The last exception vLLM logged that is not itself a report of the engine's death."""
    if errors is None or not errors.exists():
        return None
    cause = None
    for line in errors.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        exception = record.get("exception")
        if exception and not exception.startswith(_CONSEQUENCES):
            cause = exception
    return cause


def death_cause(errors: Path | None, processes: list[Any]) -> str:
    """Why an engine died: what its processes logged (``root_cause``), or how the first of
    ``processes`` (vLLM's engine processes, found by the adapter) that ended did."""
    cause = root_cause(errors)
    if cause:
        return cause
    for process in processes:
        code = getattr(process, "exitcode", None)
        if code is None:
            continue
        if code < 0:
            name = signal.Signals(-code).name
            return f"the engine process was killed by {name} (out of memory, or by a person)"
        return f"the engine process exited with code {code}"
    return "the engine process exited"
