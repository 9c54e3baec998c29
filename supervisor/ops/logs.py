"""structlog configuration: one JSON line per event on stderr (or a console renderer).

Logging is best-effort telemetry: a failure to write a log line must never change what the
daemon does, so the logger factory swallows write errors.

Field names are snake_case with their unit (`duration_ms`, `retry_s`), except the
`sandbox.startup-stage` facts, which keep the names the platform's boot timeline reads
(`duration`, `sessionId`: docs/protocol.md §5.2). tests/test_log_fields.py checks every call.
"""

from __future__ import annotations

import logging
import sys
from enum import Enum
from typing import TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _SafeWriter:
    """A file-like that drops a line rather than raise (closed or full stderr)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        try:
            self._stream.write(text)
        except Exception:  # noqa: BLE001 - telemetry must not change behaviour
            pass

    def flush(self) -> None:
        try:
            self._stream.flush()
        except Exception:  # noqa: BLE001
            pass


def enum_values(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """An Enum field logs as its value: `code=1000`, not the console renderer's repr
    `<CloseReason.NORMAL_CLOSURE: 1000>` (JSON lines already wrote an IntEnum's value, but a
    plain Enum's repr). One rule for both formats, so a field reads the same in each."""
    for key, value in event_dict.items():
        if isinstance(value, Enum):
            event_dict[key] = value.value
    return event_dict


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    renderer = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            enum_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        # WriteLogger writes the line with its newline in one call (PrintLogger's print()
        # makes two, and so two system calls on the unbuffered file a service's stderr is),
        # then flushes: write and flush alone, so the cast states that _SafeWriter is enough
        # of a TextIO for that.
        logger_factory=structlog.WriteLoggerFactory(
            file=cast(TextIO, _SafeWriter(stream or sys.stderr))
        ),
        cache_logger_on_first_use=False,
    )


def safe_log(logger: FilteringBoundLogger, event: str, **fields: object) -> None:
    """Emit a log fact whose failure must not matter (startup-stage facts, docs/protocol.md §5.2)."""
    try:
        logger.info(event, **fields)
    except Exception:  # noqa: BLE001
        pass
