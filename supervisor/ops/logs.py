"""structlog configuration: one JSON line per event on stderr (or a console renderer).

Logging is best-effort telemetry: a failure to write a log line must never change what the
daemon does, so the logger factory swallows write errors.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger

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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        # PrintLogger only print()s to its file, which needs write and flush alone: the
        # cast states that _SafeWriter is enough of a TextIO for that.
        logger_factory=structlog.PrintLoggerFactory(
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
