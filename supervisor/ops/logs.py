"""structlog configuration: one JSON line per event on stderr (or a console renderer).

Logging is best-effort telemetry: a failure to write a log line must never change what the
daemon does, so the logger factory swallows write errors.

Field names are snake_case with their unit (`duration_ms`, `retry_s`), except the
`sandbox.startup-stage` facts, which keep the names the platform's boot timeline reads
(`duration`, `sessionId`: docs/protocol.md §5.2). tests/test_log_fields.py checks every call.

A line is on the hot path of every tool call and connection, so the JSON format renders in
one processor (`render_json_line`: level, timestamp, traceback, enum values and the JSON in
one pass, about half the cost of structlog's six-processor chain) and loggers are cached on
first use. The configuration stays live all the same: the level is read at each call
(`LiveLevelLogger`), and the sink and the processor list are changed in place, so a second
`configure_logging` (the suite makes one per test that reads the log) reaches loggers that
were cached before it. Only through `configure_logging`: a direct `structlog.configure`
with a new processor list or wrapper class does not reach a cached logger (editing the list
in place, as structlog.testing.capture_logs does, still does). structlog's contextvars are
not merged, as nothing binds any: a `bind_contextvars` would need `merge_contextvars` back.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _SafeWriter:
    """A file-like that drops a line rather than raise (closed or full stderr). One instance
    for the process; `configure_logging` points it at its stream."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        try:
            self.stream.write(text)
        except Exception:  # noqa: BLE001 - telemetry must not change behaviour
            pass

    def flush(self) -> None:
        try:
            self.stream.flush()
        except Exception:  # noqa: BLE001
            pass


class _Threshold:
    """The configured level, read by every logging call (see LiveLevelLogger)."""

    level = logging.INFO


def _level_method(level: int, name: str) -> Callable[..., Any]:
    def method(self: structlog.BoundLoggerBase, event: str, *args: Any, **fields: Any) -> Any:
        if level < _Threshold.level:
            return None
        # %-arguments as structlog's filtering logger takes them (the daemon passes none).
        return self._proxy_to_logger(name, event % args if args else event, **fields)

    method.__name__ = name
    return method


class LiveLevelLogger(structlog.BoundLoggerBase):
    """structlog's filtering logger with the threshold read at each call instead of fixed
    in the class: a cached logger follows a later `configure_logging`. The synchronous
    methods of structlog's FilteringBoundLogger; not its async variants, which the daemon
    never calls (tests/test_log_fields.py checks every call)."""

    debug = _level_method(logging.DEBUG, "debug")
    info = _level_method(logging.INFO, "info")
    warning = _level_method(logging.WARNING, "warning")
    error = _level_method(logging.ERROR, "error")
    critical = _level_method(logging.CRITICAL, "critical")

    # structlog's aliases, so that a call the filtering logger accepts works here too.
    warn = warning
    fatal = critical
    msg = info

    def exception(self, event: str, *args: Any, **fields: Any) -> Any:
        fields.setdefault("exc_info", True)
        return self.error(event, *args, **fields)

    def log(self, level: int, event: str, *args: Any, **fields: Any) -> Any:
        if level < _Threshold.level:
            return None
        name = logging.getLevelName(level).lower()
        return self._proxy_to_logger(name, event % args if args else event, **fields)

    def is_enabled_for(self, level: int) -> bool:
        return level >= _Threshold.level

    def get_effective_level(self) -> int:
        return _Threshold.level


def enum_values(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """An Enum field logs as its value: `code=1000`, not the console renderer's repr
    `<CloseReason.NORMAL_CLOSURE: 1000>`. One rule for both formats (the JSON format's is
    `_json_value`), so a field reads the same in each."""
    for key, value in event_dict.items():
        if isinstance(value, Enum):
            event_dict[key] = value.value
    return event_dict


def _json_value(value: object) -> object:
    """What JSON cannot encode itself: an Enum as its value (an IntEnum or a str Enum already
    encodes as its value), anything else as structlog renders it (`__structlog__`, else repr).
    Being the encoder's hook, it also reaches an Enum nested in a list or a dict (the console
    format, as structlog's JSONRenderer did, shows a nested one's repr); the daemon logs no
    nested Enum."""
    if isinstance(value, Enum):
        return value.value
    render = getattr(value, "__structlog__", None)
    return render() if callable(render) else repr(value)


# json.dumps's defaults (", " and ": ", ASCII): the lines read as structlog's JSONRenderer wrote them.
_ENCODE = json.JSONEncoder(default=_json_value).encode
_LEVEL_OF_METHOD = {"warn": "warning", "exception": "error"}


class _UtcClock:
    """ISO 8601 UTC with microseconds (`2026-12-01T22:17:07.123456Z`), the date and time of
    day formatted once per second. The second and its text are one tuple, replaced in one
    assignment: a worker thread that logs meanwhile reads either the old pair or the new one,
    never one second's text with another's microseconds."""

    def __init__(self) -> None:
        self._cached: tuple[int, str] = (-1, "")

    def now(self) -> str:
        second, micros = divmod(time.time_ns() // 1000, 1_000_000)
        cached_second, prefix = self._cached
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._cached = (second, prefix)
        return f"{prefix}.{micros:06d}Z"


_CLOCK = _UtcClock()


def render_json_line(_logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
    """The JSON format's whole chain in one processor: level, timestamp, traceback (from
    `exc_info`, as structlog's format_exc_info renders it), Enum values, JSON."""
    event_dict["level"] = _LEVEL_OF_METHOD.get(method, method)
    event_dict["timestamp"] = _CLOCK.now()
    if "exc_info" in event_dict:
        event_dict = structlog.processors.format_exc_info(_logger, method, event_dict)
    return _ENCODE(event_dict)


_SINK = _SafeWriter(sys.stderr)
_PROCESSORS: list[Processor] = []


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    _Threshold.level = LEVELS[level]
    _SINK.stream = stream or sys.stderr
    _PROCESSORS[:] = (
        [render_json_line]
        if fmt == "json"
        else [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            enum_values,
            structlog.dev.ConsoleRenderer(colors=False),
        ]
    )
    structlog.configure(
        processors=_PROCESSORS,
        wrapper_class=LiveLevelLogger,
        # WriteLogger writes the line with its newline in one call (PrintLogger's print()
        # makes two, and so two system calls on the unbuffered file a service's stderr is),
        # then flushes: write and flush alone, so the cast states that _SafeWriter is enough
        # of a TextIO for that.
        logger_factory=structlog.WriteLoggerFactory(file=cast(TextIO, _SINK)),
        cache_logger_on_first_use=True,
    )


def safe_log(logger: FilteringBoundLogger, event: str, **fields: object) -> None:
    """Emit a log fact whose failure must not matter (startup-stage facts, docs/protocol.md §5.2)."""
    try:
        logger.info(event, **fields)
    except Exception:  # noqa: BLE001
        pass
