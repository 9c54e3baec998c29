"""Tool calls (docs/protocol.md §7.1): one closed model per tool, chosen by `tool_name`.

A `tool.call` frame's body is validated here, in a second stage after the envelope, because
the answer depends on what could be read: without a readable `call_id` the peer gets an
`error` frame (`invalid_frame`); with one, every other failure is a journaled `tool.result`
`invalid_parameters` for that call.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, StringConstraints, TypeAdapter, ValidationError

from sandbox_supervisor.protocol.errors import INVALID_FRAME, INVALID_PARAMETERS
from sandbox_supervisor.protocol.fields import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    NO_NUL_PATTERN,
    UUID_PATTERN,
    CallId,
    Count,
    EnvMap,
    IdempotencyKey,
    RelativePath,
    Scope,
    StrictModel,
    optional_field,
)

__all__ = [
    "TOOL_NAMES",
    "TOOL_SCOPES",
    "TOOL_SPECS",
    "PatchResult",
    "ReadFileResult",
    "ShellResult",
    "StreamSummary",
    "ToolSpec",
    "tool_spec",
    "ApplyFilePatchCall",
    "ApplyFilePatchParams",
    "ExecuteShellCommandCall",
    "ExecuteShellCommandParams",
    "ProcessStarted",
    "PtyRequest",
    "StartProcessCall",
    "StartProcessParams",
    "ReadFileCall",
    "ReadFileParams",
    "ToolCall",
    "ToolCallBody",
    "ToolCallError",
    "call_digest",
    "is_call_id",
    "parse_tool_call",
]

ToolName = Literal["apply_file_patch", "execute_shell_command", "read_file", "start_process"]
TOOL_NAMES: tuple[ToolName, ...] = get_args(ToolName)

MAX_COMMAND_CHARS = 16384
MIN_TIMEOUT_MS = 1
MAX_TIMEOUT_MS = 60000
DEFAULT_TIMEOUT_MS = 30000
MAX_READ_LENGTH = 65536
# start_process: no 60 s cap (a dev server runs for hours); a timeout, when given, is capped
# by what a JSON number holds exactly. The daemon's exec.process_max_timeout_ms may lower it.
MAX_PROCESS_TIMEOUT_MS = 2**53 - 1
# A terminal's size in character cells: ioctl(TIOCSWINSZ) takes 16-bit values; beyond a few
# thousand no terminal exists, and a bound keeps a hostile size from costing anything.
MAX_PTY_CELLS = 4096
# TERM names a terminfo entry: a short name of this alphabet, never a path or a shell word.
TERM_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
# A git blob SHA-1 in lower-case hex (what `git hash-object` prints).
GIT_SHA_PATTERN = r"^[0-9a-f]{40}$"
# ToolCallError.tool_name echoes what the caller sent (into a journaled tool.result); cap it
# so a junk name cannot bloat the journal.
MAX_ECHOED_TOOL_NAME_CHARS = 128
# Longest "where: what" text of an invalid_parameters message.
MAX_ERROR_MESSAGE_CHARS = 240

_UUID_RE = re.compile(UUID_PATTERN)


def is_call_id(value: object) -> bool:
    """True when `value` is a call_id the protocol can answer to (a canonical uuid string)."""
    return isinstance(value, str) and _UUID_RE.fullmatch(value) is not None


class ApplyFilePatchParams(StrictModel):
    path: RelativePath
    diff: str  # a unified diff of that one file; its content is checked when applied
    base_sha: Annotated[str, StringConstraints(pattern=GIT_SHA_PATTERN)]


class ExecuteShellCommandParams(StrictModel):
    command: Annotated[
        str, StringConstraints(min_length=1, max_length=MAX_COMMAND_CHARS, pattern=NO_NUL_PATTERN)
    ]
    timeout_ms: Annotated[int, Field(ge=MIN_TIMEOUT_MS, le=MAX_TIMEOUT_MS)] = DEFAULT_TIMEOUT_MS
    # Relative to agent.cwd, in the same jail as apply_file_patch paths.
    cwd: RelativePath | None = optional_field()
    env: EnvMap | None = optional_field()


class PtySize(StrictModel):
    rows: Annotated[int, Field(ge=1, le=MAX_PTY_CELLS)]
    cols: Annotated[int, Field(ge=1, le=MAX_PTY_CELLS)]


class PtyRequest(PtySize):
    """A terminal for the process (docs/protocol.md §7.7.3): its size and `TERM`."""

    term: Annotated[str, StringConstraints(pattern=TERM_PATTERN)] | None = optional_field()


class StartProcessParams(StrictModel):
    command: Annotated[
        str, StringConstraints(min_length=1, max_length=MAX_COMMAND_CHARS, pattern=NO_NUL_PATTERN)
    ]
    # Absent: no timeout (the daemon's exec.process_max_timeout_ms, when set, applies).
    timeout_ms: Annotated[int, Field(ge=MIN_TIMEOUT_MS, le=MAX_PROCESS_TIMEOUT_MS)] | None = optional_field()
    cwd: RelativePath | None = optional_field()
    env: EnvMap | None = optional_field()
    pty: PtyRequest | None = optional_field()


class ReadFileParams(StrictModel):
    path: RelativePath
    offset: Count = 0
    length: Annotated[int, Field(ge=1, le=MAX_READ_LENGTH)] | None = optional_field()


# --- results (the `result` of an ok tool.result) ---


class StreamSummary(StrictModel):
    bytes: Count
    head: str
    tail: str
    truncated: bool  # the spool hit its cap


class ShellResult(StrictModel):
    """`execute_shell_command` result (docs/protocol.md §7.4.3); `exec.completed` adds `call_id`."""

    exit_code: int | None
    signal: str | None  # a name such as "SIGKILL"
    timed_out: bool
    duration_ms: Count
    stdout: StreamSummary
    stderr: StreamSummary


class PatchResult(StrictModel):
    """`apply_file_patch` result (docs/protocol.md §7.5)."""

    path: str
    old_sha: str
    new_sha: str
    hunks: Count
    bytes: Count


class ProcessStarted(StrictModel):
    """`start_process` result (docs/protocol.md §7.7.1): the process runs; its `call_id` is
    its handle for every `exec.*` frame."""

    pid: Annotated[int, Field(ge=1)]
    pgid: Annotated[int, Field(ge=1)]
    started_at: float  # Unix time in seconds
    pty: bool


class ReadFileResult(StrictModel):
    """`read_file` result (docs/protocol.md §7.3)."""

    path: str
    sha: str
    size: Count
    offset: Count
    length: Count
    encoding: Literal["utf-8", "base64"]
    content: str
    eof: bool


ToolParameters = ApplyFilePatchParams | ExecuteShellCommandParams | ReadFileParams | StartProcessParams


class ToolCall(StrictModel):
    """A validated tool call; the subclasses below narrow it per tool."""

    tool_name: ToolName
    call_id: CallId  # kept exactly as given: it is echoed in every answer to this call
    idempotency_key: IdempotencyKey | None = optional_field()
    parameters: ToolParameters


class ApplyFilePatchCall(ToolCall):
    tool_name: Literal["apply_file_patch"]
    idempotency_key: IdempotencyKey  # required: a patch must never apply twice
    parameters: ApplyFilePatchParams


class ExecuteShellCommandCall(ToolCall):
    tool_name: Literal["execute_shell_command"]
    idempotency_key: IdempotencyKey  # required: a command must never run twice
    parameters: ExecuteShellCommandParams


class StartProcessCall(ToolCall):
    tool_name: Literal["start_process"]
    idempotency_key: IdempotencyKey  # required: a process must never start twice
    parameters: StartProcessParams


class ReadFileCall(ToolCall):
    tool_name: Literal["read_file"]
    idempotency_key: IdempotencyKey | None = optional_field()  # optional, honoured when given
    parameters: ReadFileParams


# The discriminator makes `tool_name` pick the parameter schema; a body is never matched
# against the other tools' schemas to see which one fits.
ToolCallBody = Annotated[
    ApplyFilePatchCall | ExecuteShellCommandCall | ReadFileCall | StartProcessCall, Field(discriminator="tool_name")
]
_TOOL_CALL_ADAPTER: TypeAdapter[ToolCall] = TypeAdapter(ToolCallBody)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool's wire declaration: its name, the scope a connection needs for it, its call,
    parameter and result models. The daemon's runtime binds each to how it runs."""

    name: ToolName
    scope: Scope
    call: type[ToolCall]
    parameters: type[StrictModel]
    result: type[StrictModel]


# Every tool, once. A new tool adds its models above, its name to ToolName and its call
# class to ToolCallBody (static types need both spelled out; tests/test_registry.py holds
# them equal to this table), and one entry here.
TOOL_SPECS: tuple[ToolSpec, ...] = (
    ToolSpec("apply_file_patch", "files:write", ApplyFilePatchCall, ApplyFilePatchParams, PatchResult),
    ToolSpec("execute_shell_command", "shell:exec", ExecuteShellCommandCall, ExecuteShellCommandParams, ShellResult),
    ToolSpec("read_file", "files:read", ReadFileCall, ReadFileParams, ReadFileResult),
    ToolSpec("start_process", "shell:exec", StartProcessCall, StartProcessParams, ProcessStarted),
)
TOOL_SCOPES: dict[str, Scope] = {spec.name: spec.scope for spec in TOOL_SPECS}


def tool_spec(name: str) -> ToolSpec:
    """The spec of a tool the protocol defines (KeyError for any other name)."""
    return _SPECS_BY_NAME[name]


_SPECS_BY_NAME: dict[str, ToolSpec] = {spec.name: spec for spec in TOOL_SPECS}


class ToolCallError(ValueError):
    """A tool call that cannot run.

    `code` is INVALID_FRAME when `call_id` is unreadable (answer: an `error` frame) and
    INVALID_PARAMETERS otherwise (answer: a `tool.result` ok:false for `call_id`).
    `tool_name` and `idempotency_key` are what the caller sent when they were readable
    strings, else None, so the tool.result can echo them.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        call_id: str | None,
        tool_name: str | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.call_id = call_id
        self.tool_name = tool_name
        self.idempotency_key = idempotency_key


def _readable_tool_name(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_ECHOED_TOOL_NAME_CHARS:
        return value
    return None


def _readable_idempotency_key(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_IDEMPOTENCY_KEY_CHARS:
        return value
    return None


def _describe(error: ValidationError, tool_name: str) -> str:
    """First problem as "where: what", without the offending value."""
    first = error.errors(include_url=False, include_input=False)[0]
    loc = first["loc"]
    if loc and loc[0] == tool_name:
        loc = loc[1:]  # the union tag pydantic prefixes; the caller knows its tool
    where = ".".join(str(part)[:64] for part in loc)
    text = f"{where}: {first['msg']}" if where else first["msg"]
    return text[:MAX_ERROR_MESSAGE_CHARS]


def parse_tool_call(body: dict[str, Any]) -> ToolCall:
    """Validate a `tool.call` body; raise only ToolCallError."""
    call_id = body.get("call_id") if isinstance(body, dict) else None
    if not is_call_id(call_id):
        raise ToolCallError(INVALID_FRAME, "Tool call has no readable call_id.", call_id=None)
    tool_name = _readable_tool_name(body.get("tool_name"))
    idempotency_key = _readable_idempotency_key(body.get("idempotency_key"))
    if tool_name not in TOOL_NAMES:
        raise ToolCallError(
            INVALID_PARAMETERS,
            "Unknown tool_name.",
            call_id=call_id,
            tool_name=tool_name,
            idempotency_key=idempotency_key,
        )
    try:
        return _TOOL_CALL_ADAPTER.validate_python(body)
    except ValidationError as error:
        raise ToolCallError(
            INVALID_PARAMETERS,
            f"Invalid tool call: {_describe(error, tool_name)}.",
            call_id=call_id,
            tool_name=tool_name,
            idempotency_key=idempotency_key,
        ) from None


def call_digest(tool_name: str, parameters: BaseModel) -> str:
    """SHA-256 hex identifying (tool_name, parameters) for idempotency records.

    Parameters are dumped with their defaults, so an omitted `timeout_ms` and an explicit
    30000 are the same call; keys are sorted, so field order does not matter. Keep stable:
    digests are persisted.
    """
    canonical = json.dumps(
        [tool_name, parameters.model_dump(mode="json")],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    # surrogatepass: total even for a Python str with a lone surrogate (JSON input cannot
    # carry one, the frame parser refuses it).
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
