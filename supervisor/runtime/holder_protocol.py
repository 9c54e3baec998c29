"""What the daemon and a process's holder share: the files, the control protocol, the codec.

(Records are NamedTuples, not dataclasses: importing `dataclasses` costs a holder about 9 ms
of its start and 1.5 MiB of private memory.)

A holder (`holder.py`) owns one process. This module is the contract between it and the
daemon, as plain data and pure functions, with no I/O beyond reading and writing the small
JSON files (see docs/internals.md, "The holder"):

- `spec.json` (`HolderSpec`, written by the daemon), `holder.json` (`HolderInfo`, or an error,
  written by the holder once the process is spawned), `exit.json` (`ExitRecord`, written once
  the process has exited);
- the control socket's newline-delimited JSON: requests (`encode_*` for the daemon,
  `parse_request` for the holder), replies and events (`reply_ok`, `reply_error`, `event_*`
  for the holder, `decode_message` for the daemon), and `LineSplitter`, the bounded framing
  both sides use.

Sans-IO: the daemon's trio code feeds received bytes to a `LineSplitter` and hands each line
to `decode_message`; it sends what the `encode_*` functions return. Stdlib only: the holder
imports this module, and the holder must not import pydantic, trio or structlog.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import signal
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from sandbox_supervisor.daemon.runtime.spool import replace_atomically
from sandbox_supervisor.protocol.plain import STREAMS, Stream

__all__ = [
    "CONTROL_SOCKET",
    "EXIT_FILE",
    "HOLDER_FILE",
    "MAX_LINE_BYTES",
    "SPEC_FILE",
    "EndedEvent",
    "ExitRecord",
    "ExitedEvent",
    "HolderInfo",
    "HolderProtocolError",
    "HolderSpec",
    "HolderSpawnFailed",
    "LineSplitter",
    "LineTooLong",
    "Message",
    "OutputEvent",
    "Reply",
    "Request",
    "RequestError",
    "SpecError",
    "control_socket_path",
    "decode_message",
    "encode_close_stdin",
    "encode_modules",
    "encode_resize",
    "encode_signal",
    "encode_stdin",
    "encode_terminate",
    "encode_watch",
    "event_ended",
    "event_exited",
    "event_output",
    "parse_request",
    "parse_spec",
    "read_exit",
    "read_holder",
    "reply_error",
    "reply_ok",
    "reply_stdin",
    "write_json_atomic",
]

SPEC_FILE = "spec.json"
HOLDER_FILE = "holder.json"
EXIT_FILE = "exit.json"
CONTROL_SOCKET = "control.sock"

# The longest line either side accepts. A stdin request carries its bytes in base64 (4/3 of
# them), and the holder takes at most its stdin buffer (64 KiB) per write, so a client gains
# nothing from sending more; the bound keeps a confused peer from growing the other's memory.
MAX_LINE_BYTES = 256 * 1024
# Terminal sizes a resize may ask for (struct winsize holds unsigned shorts).
MAX_TERMINAL_DIMENSION = 0xFFFF
OOM_SCORE_ADJ_RANGE = (-1000, 1000)
MAX_ID = 2**32 - 2  # uid/gid: (uid_t)-1 means "no change" to the kernel
STDIN_MODES = ("pipe", "null")

# Reply codes (`{"ok": false, "code": ...}`); stable: the daemon maps them.
BAD_REQUEST = "bad_request"
UNKNOWN_OP = "unknown_op"
LINE_TOO_LONG = "line_too_long"
STDIN_GAP = "stdin_gap"
STDIN_CLOSED = "stdin_closed"
NOT_RUNNING = "not_running"
NOT_A_TERMINAL = "not_a_terminal"
HOLDER_ERROR = "holder_error"  # the holder failed on this request (a bug); it goes on
# holder.json error codes: the holder could not start the process (nothing ran).
SPAWN_FAILED = "spawn_failed"
BAD_SPEC = "bad_spec"
HOLDER_FAILED = "holder_failed"


# --- files ---------------------------------------------------------------------------------


class SpecError(ValueError):
    """spec.json is not a valid spec (the holder refuses it: holder.json `bad_spec`)."""


class TerminalSize(NamedTuple):
    rows: int
    cols: int


class HolderSpec(NamedTuple):
    """What to run and how (spec.json). Ids None: no switch, the holder's own (root's)."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    uid: int | None = None
    gid: int | None = None
    # With a uid and no groups, the process gets no supplementary group at all (never the
    # holder's: root's group 0 must not leak to the command user).
    groups: tuple[int, ...] | None = None
    pty: TerminalSize | None = None
    timeout_s: float | None = None
    kill_grace_s: float = 2.0
    spool_max_bytes: int = 64 * 1024 * 1024
    oom_score_adj: int | None = None
    cgroup: str | None = None
    # More cgroup directories the process joins with it (runtime/cgroups.py: v1 `memory` and
    # `pids` directories holding its limits, beside the membership directory `cgroup`).
    cgroup_also: tuple[str, ...] = ()

    @property
    def cgroup_directories(self) -> tuple[str, ...]:
        """Every directory the process joins, the membership (`cgroup`) first; () for none."""
        return () if self.cgroup is None else (self.cgroup, *self.cgroup_also)
    # Addition to the shared design: "null" gives the process /dev/null as stdin (today's
    # execute_shell_command), "pipe" a pipe fed by `stdin` requests. Ignored with a pty.
    stdin: Literal["pipe", "null"] = "pipe"

    def to_json(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "cwd": self.cwd,
            "env": dict(self.env),
            "uid": self.uid,
            "gid": self.gid,
            "groups": None if self.groups is None else list(self.groups),
            "pty": None if self.pty is None else {"rows": self.pty.rows, "cols": self.pty.cols},
            "timeout_s": self.timeout_s,
            "kill_grace_s": self.kill_grace_s,
            "spool_max_bytes": self.spool_max_bytes,
            "oom_score_adj": self.oom_score_adj,
            "cgroup": self.cgroup,
            "cgroup_also": list(self.cgroup_also),
            "stdin": self.stdin,
        }

    @property
    def streams(self) -> tuple[Stream, ...]:
        """A terminal has one stream (what the process writes to it), stdout."""
        return ("stdout",) if self.pty is not None else STREAMS


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or "\x00" in value:
        raise SpecError(f"{name} must be a string without NUL")
    return value


def _int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"{name} must be an integer in {low}..{high}")
    return value


def _optional_int(document: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = document.get(name)
    return None if value is None else _int(value, name, low, high)


def _seconds(value: object, name: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{name} must be a number of seconds")
    if value < 0 or (positive and value == 0):
        raise SpecError(f"{name} must be {'positive' if positive else 'at least 0'}")
    return float(value)


def parse_spec(document: object) -> HolderSpec:
    """A spec from its JSON document; SpecError naming the first field that is wrong."""
    if not isinstance(document, dict):
        raise SpecError("the spec must be an object")
    known = set(HolderSpec._fields)
    unknown = sorted(set(document) - known)
    if unknown:
        raise SpecError(f"unknown fields: {', '.join(unknown)}")
    argv = document.get("argv")
    if not isinstance(argv, list) or not argv:
        raise SpecError("argv must be a non-empty list")
    env = document.get("env", {})
    if not isinstance(env, dict):
        raise SpecError("env must be an object")
    groups = document.get("groups")
    if groups is not None and not isinstance(groups, list):
        raise SpecError("groups must be a list or null")
    pty = document.get("pty")
    size = None
    if pty is not None:
        if not isinstance(pty, dict) or set(pty) != {"rows", "cols"}:
            raise SpecError("pty must be {rows, cols} or null")
        size = TerminalSize(
            _int(pty["rows"], "pty.rows", 1, MAX_TERMINAL_DIMENSION),
            _int(pty["cols"], "pty.cols", 1, MAX_TERMINAL_DIMENSION),
        )
    timeout = document.get("timeout_s")
    cgroup = document.get("cgroup")
    cgroup_also = document.get("cgroup_also", [])
    if not isinstance(cgroup_also, list) or (cgroup_also and cgroup is None):
        raise SpecError("cgroup_also must be a list, and needs a cgroup")
    stdin = document.get("stdin", "pipe")
    if stdin not in STDIN_MODES:
        raise SpecError(f"stdin must be one of {STDIN_MODES}")
    return HolderSpec(
        argv=tuple(_text(item, "argv[]") for item in argv),
        cwd=_text(document.get("cwd"), "cwd"),
        env={_text(k, "env name"): _text(v, f"env[{k}]") for k, v in env.items()},
        uid=_optional_int(document, "uid", 0, MAX_ID),
        gid=_optional_int(document, "gid", 0, MAX_ID),
        groups=None if groups is None else tuple(_int(g, "groups[]", 0, MAX_ID) for g in groups),
        pty=size,
        timeout_s=None if timeout is None else _seconds(timeout, "timeout_s", positive=True),
        kill_grace_s=_seconds(document.get("kill_grace_s", 2.0), "kill_grace_s", positive=False),
        spool_max_bytes=_int(document.get("spool_max_bytes", 64 * 1024 * 1024), "spool_max_bytes", 0, 2**62),
        oom_score_adj=_optional_int(document, "oom_score_adj", *OOM_SCORE_ADJ_RANGE),
        cgroup=None if cgroup is None else _text(cgroup, "cgroup"),
        cgroup_also=tuple(_text(item, "cgroup_also[]") for item in cgroup_also),
        stdin="null" if stdin == "null" else "pipe",
    )


class HolderInfo(NamedTuple):
    """holder.json: who holds the process, and the process (pid + start time = identity)."""

    holder_pid: int
    holder_start_ticks: int
    pid: int
    pgid: int
    start_ticks: int
    started_at: str  # UTC, ISO 8601

    def to_json(self) -> dict[str, Any]:
        return {
            "holder_pid": self.holder_pid,
            "holder_start_ticks": self.holder_start_ticks,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_ticks": self.start_ticks,
            "started_at": self.started_at,
        }


class HolderSpawnFailed(Exception):
    """holder.json says the process could not be started: nothing ran."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ExitRecord(NamedTuple):
    """exit.json: how the process ended. `exit_code` None when a signal ended it."""

    exit_code: int | None
    signal: str | None  # a name such as "SIGKILL"
    timed_out: bool
    oom_killed: bool | None  # None: not known (no cgroup to ask)
    duration_ms: int
    ended_at: str  # UTC, ISO 8601

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "oom_killed": self.oom_killed,
            "duration_ms": self.duration_ms,
            "ended_at": self.ended_at,
        }

    @classmethod
    def from_json(cls, document: object) -> ExitRecord:
        if not isinstance(document, dict):
            raise HolderProtocolError("an exit record must be an object")
        try:
            exit_code, sig = document["exit_code"], document["signal"]
            oom = document["oom_killed"]
            record = cls(
                exit_code=None if exit_code is None else int(exit_code),
                signal=None if sig is None else str(sig),
                timed_out=bool(document["timed_out"]),
                oom_killed=None if oom is None else bool(oom),
                duration_ms=int(document["duration_ms"]),
                ended_at=str(document["ended_at"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise HolderProtocolError(f"malformed exit record: {exc}") from None
        return record


def write_json_atomic(path: Path, document: dict[str, Any], *, durable: bool = False) -> None:
    """Replace `path` with `document` (temporary file + rename): a reader sees none or all.

    `durable`: fsync the file before the rename and the directory after, so the record
    survives a power loss once this returns (exit.json: an exit status is reported once).
    """
    replace_atomically(path, json.dumps(document, sort_keys=True), durable=durable)


def read_holder(directory: Path) -> HolderInfo | None:
    """holder.json, None while it is not written; HolderSpawnFailed when it records an error."""
    try:
        document = json.loads((directory / HOLDER_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise HolderProtocolError(f"malformed {HOLDER_FILE}: {exc}") from None
    if not isinstance(document, dict):
        raise HolderProtocolError(f"malformed {HOLDER_FILE}")
    if "error" in document:
        error = document["error"]
        raise HolderSpawnFailed(str(error.get("code")), str(error.get("message")))
    try:
        return HolderInfo(
            holder_pid=int(document["holder_pid"]),
            holder_start_ticks=int(document["holder_start_ticks"]),
            pid=int(document["pid"]),
            pgid=int(document["pgid"]),
            start_ticks=int(document["start_ticks"]),
            started_at=str(document["started_at"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HolderProtocolError(f"malformed {HOLDER_FILE}: {exc}") from None


def read_exit(directory: Path) -> ExitRecord | None:
    """exit.json, None while the process has not ended (its presence means "ended")."""
    try:
        text = (directory / EXIT_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return ExitRecord.from_json(json.loads(text))
    except ValueError as exc:
        raise HolderProtocolError(f"malformed {EXIT_FILE}: {exc}") from None


def control_socket_path(directory_fd: int) -> str:
    """A path to a holder's control socket that fits sun_path (108 bytes) whatever the
    state directory's length: through the caller's descriptor of the holder's directory."""
    return f"/proc/self/fd/{directory_fd}/{CONTROL_SOCKET}"


# --- framing -------------------------------------------------------------------------------


class HolderProtocolError(ValueError):
    """A line from the peer that is not what the protocol allows (the daemon's side)."""


class LineTooLong(HolderProtocolError):
    """The peer sent more than MAX_LINE_BYTES without a newline."""


class LineSplitter:
    """Bytes in, complete lines out (without the newline); at most `max_line` bytes buffered."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._max = max_line
        self._partial = bytearray()

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        self._partial += data
        *lines, rest = self._partial.split(b"\n")
        if len(rest) > self._max:
            raise LineTooLong(f"a line longer than {self._max} bytes")
        self._partial = bytearray(rest)
        too_long = [line for line in lines if len(line) > self._max]
        if too_long:
            raise LineTooLong(f"a line longer than {self._max} bytes")
        return [bytes(line) for line in lines]


def _line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode() + b"\n"


# --- requests: the daemon encodes, the holder parses ----------------------------------------


def encode_watch() -> bytes:
    return _line({"op": "watch"})


def encode_stdin(offset: int, data: bytes) -> bytes:
    # Every keystroke's request: formatted directly, the bytes `_line` would make (sorted keys,
    # no spaces; base64 needs no JSON escaping), at a fraction of json.dumps's cost.
    return b'{"data":"%s","offset":%d,"op":"stdin"}\n' % (base64.b64encode(data), int(offset))


def encode_close_stdin(offset: int) -> bytes:
    return _line({"op": "close_stdin", "offset": offset})


def encode_resize(rows: int, cols: int) -> bytes:
    return _line({"op": "resize", "rows": rows, "cols": cols})


def encode_signal(name: str) -> bytes:
    return _line({"op": "signal", "signal": name})


def encode_terminate() -> bytes:
    return _line({"op": "terminate"})


def encode_modules() -> bytes:
    """Diagnostics: the holder answers with the modules it has loaded (a test checks them)."""
    return _line({"op": "modules"})


class RequestError(Exception):
    """A request the holder refuses; answered `{"ok": false, "code", "message"}`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Op = Literal["watch", "stdin", "close_stdin", "resize", "signal", "terminate", "modules"]
OPS: tuple[str, ...] = ("watch", "stdin", "close_stdin", "resize", "signal", "terminate", "modules")


class Request(NamedTuple):
    op: Op
    offset: int = 0  # stdin, close_stdin
    data: bytes = b""  # stdin
    rows: int = 0  # resize
    cols: int = 0
    signum: int = 0  # signal


def _field_int(document: dict[str, Any], name: str, high: int) -> int:
    value = document.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise RequestError(BAD_REQUEST, f"{name} must be an integer in 0..{high}")
    return value


MAX_OFFSET = 2**53 - 1  # offsets travel in JSON: exact in every implementation


def parse_request(line: bytes) -> Request:
    """One request line; RequestError (`bad_request`, `unknown_op`) when it is not one."""
    try:
        document = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past the C stack
        raise RequestError(BAD_REQUEST, "not JSON") from None
    if not isinstance(document, dict):
        raise RequestError(BAD_REQUEST, "a request is a JSON object")
    op = document.get("op")
    if op not in OPS:
        raise RequestError(UNKNOWN_OP, f"unknown op {op!r}"[:200])
    if op == "stdin":
        data = document.get("data")
        if not isinstance(data, str):
            raise RequestError(BAD_REQUEST, "data must be base64 text")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(BAD_REQUEST, "data must be base64 text") from None
        return Request("stdin", offset=_field_int(document, "offset", MAX_OFFSET), data=raw)
    if op == "close_stdin":
        return Request("close_stdin", offset=_field_int(document, "offset", MAX_OFFSET))
    if op == "resize":
        rows = _field_int(document, "rows", MAX_TERMINAL_DIMENSION)
        cols = _field_int(document, "cols", MAX_TERMINAL_DIMENSION)
        if not rows or not cols:
            raise RequestError(BAD_REQUEST, "rows and cols must be positive")
        return Request("resize", rows=rows, cols=cols)
    if op == "signal":
        name = document.get("signal")
        try:
            signum = signal.Signals[name] if isinstance(name, str) and name.startswith("SIG") else None
        except KeyError:
            signum = None
        if signum is None:
            raise RequestError(BAD_REQUEST, "signal must be a signal name such as SIGINT")
        return Request("signal", signum=int(signum))
    if op == "watch":
        return Request("watch")
    if op == "terminate":
        return Request("terminate")
    return Request("modules")


# --- replies and events: the holder encodes, the daemon decodes ------------------------------


def reply_ok(**fields: Any) -> bytes:
    return _line({"ok": True, **fields})


def reply_error(code: str, message: str, **fields: Any) -> bytes:
    return _line({"ok": False, "code": code, "message": message, **fields})


def reply_stdin(next: int, closed: bool) -> bytes:
    """`reply_ok(next=…, closed=…)`, the answer to every keystroke, formatted directly (the
    same bytes)."""
    return b'{"closed":%s,"next":%d,"ok":true}\n' % (b"true" if closed else b"false", int(next))


def event_output(stream: Stream, total: int, kept: int) -> bytes:
    """The stream's spool file now holds `kept` bytes of the `total` the process wrote
    (they differ once the cap is hit). Formatted directly, as `_line` would (one per batch
    of output: every keystroke's echo)."""
    name = b"stdout" if stream == "stdout" else b"stderr"
    return b'{"ev":"output","kept":%d,"stream":"%s","total":%d}\n' % (int(kept), name, int(total))


def event_exited(record: ExitRecord) -> bytes:
    return _line({"ev": "exited", **record.to_json()})


def event_ended() -> bytes:
    return _line({"ev": "ended"})


class Reply(NamedTuple):
    """The answer to one request, in request order. `fields`: what else it carries
    (`next` for stdin, `expected` with stdin_gap, `delivered` for signal …)."""

    ok: bool
    code: str | None = None
    message: str | None = None
    fields: Mapping[str, Any] = {}  # read-only: a NamedTuple default is shared


class OutputEvent(NamedTuple):
    stream: Stream
    total: int
    kept: int


class ExitedEvent(NamedTuple):
    record: ExitRecord


class EndedEvent(NamedTuple):
    """Every stream ended and exit.json is written: the holder is about to exit."""


Message = Reply | OutputEvent | ExitedEvent | EndedEvent


def decode_message(line: bytes) -> Message:
    """One line from a holder; HolderProtocolError when it is not a reply or an event."""
    try:
        document = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past the C stack
        raise HolderProtocolError("not JSON") from None
    if not isinstance(document, dict):
        raise HolderProtocolError("not a JSON object")
    if "ok" in document:
        ok = document.pop("ok")
        if not isinstance(ok, bool):
            raise HolderProtocolError("ok must be a boolean")
        code, message = document.pop("code", None), document.pop("message", None)
        if not ok and not (isinstance(code, str) and isinstance(message, str)):
            raise HolderProtocolError("an error reply needs a code and a message")
        return Reply(ok=ok, code=code, message=message, fields=document)
    kind = document.pop("ev", None)
    if kind == "output":
        stream, total, kept = document.get("stream"), document.get("total"), document.get("kept")
        if stream not in STREAMS or not isinstance(total, int) or not isinstance(kept, int):
            raise HolderProtocolError("malformed output event")
        return OutputEvent(stream="stdout" if stream == "stdout" else "stderr", total=total, kept=kept)
    if kind == "exited":
        return ExitedEvent(ExitRecord.from_json(document))
    if kind == "ended":
        return EndedEvent()
    raise HolderProtocolError("neither a reply nor an event")
