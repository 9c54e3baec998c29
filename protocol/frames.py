"""Frames of the control channel (docs/protocol.md §6): one closed model per kind.

Field names are the wire names, camelCase for the envelope and session frames and snake_case
for tool and exec frames (§6.1), used as is in code: no alias layer to keep in sync.

Client frames are decoded by `decode_client_frame` in one pass over the raw text (pydantic's
JSON parser validates while parsing, as fast as json.loads alone). The slow path, a second
parse to tell `unknown_kind` from `invalid_frame` and to find a readable `call_id`, runs only
for frames that already failed.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from sandbox_supervisor.protocol.bootstrap import BootstrapBody
from sandbox_supervisor.protocol.errors import INVALID_FRAME, UNKNOWN_KIND
from sandbox_supervisor.protocol.headers import MAX_SAFE_INTEGER
from sandbox_supervisor.protocol.fields import (
    CallId,
    Count,
    Generation,
    Id,
    IdempotencyKey,
    Scope,
    STREAMS,
    Seq,
    Stream,
    StrictModel,
    optional_field,
)
from sandbox_supervisor.protocol.tools import MAX_PTY_CELLS, ShellResult, is_call_id

# --- kinds ---
# Final, so each is also its Literal type: a frame model's `kind` default is the constant.
SESSION_BOOTSTRAP: Final = "session.bootstrap"
TOOL_CALL: Final = "tool.call"
EVENTS_ACK: Final = "events.ack"
EXEC_SIGNAL: Final = "exec.signal"
EXEC_READ_OUTPUT: Final = "exec.read_output"
EXEC_WRITE_STDIN: Final = "exec.write_stdin"
EXEC_CLOSE_STDIN: Final = "exec.close_stdin"
EXEC_RESIZE: Final = "exec.resize"
EXEC_LIST: Final = "exec.list"
# The client frames that may carry a request_id (echoed in their answer).
REQUEST_ID_KINDS = frozenset(
    {EXEC_SIGNAL, EXEC_READ_OUTPUT, EXEC_WRITE_STDIN, EXEC_CLOSE_STDIN, EXEC_RESIZE, EXEC_LIST}
)
CLIENT_KINDS = frozenset(
    {
        SESSION_BOOTSTRAP,
        TOOL_CALL,
        EVENTS_ACK,
        EXEC_SIGNAL,
        EXEC_READ_OUTPUT,
        EXEC_WRITE_STDIN,
        EXEC_CLOSE_STDIN,
        EXEC_RESIZE,
        EXEC_LIST,
    }
)

RUNTIME_STATE: Final = "runtime.state"
SESSION_BOOTSTRAP_REJECTED: Final = "session.bootstrap.rejected"
TOOL_PENDING: Final = "tool.pending"
TOOL_REPLAYED: Final = "tool.replayed"
EXEC_OUTPUT_PAGE: Final = "exec.output_page"
EXEC_STDIN_ACK: Final = "exec.stdin_ack"
EXEC_PROCESSES: Final = "exec.processes"
ERROR: Final = "error"
EXEC_STARTED: Final = "exec.started"
EXEC_OUTPUT: Final = "exec.output"
EXEC_COMPLETED: Final = "exec.completed"
TOOL_RESULT: Final = "tool.result"
EVENT_KINDS = frozenset({EXEC_STARTED, EXEC_OUTPUT, EXEC_COMPLETED, TOOL_RESULT})
# In place of a journaled event the socket's assertion does not let it see (§9.1): the seq
# alone. Never journaled itself; each socket's sender writes it.
EVENT_WITHHELD: Final = "event.withheld"
SERVER_KINDS = frozenset(
    {
        RUNTIME_STATE,
        SESSION_BOOTSTRAP_REJECTED,
        TOOL_PENDING,
        TOOL_REPLAYED,
        EXEC_OUTPUT_PAGE,
        EXEC_STDIN_ACK,
        EXEC_PROCESSES,
        ERROR,
        EVENT_WITHHELD,
        *EVENT_KINDS,
    }
)

# --- messages ---
# The message of generation_mismatch, sent by the socket (§4) and by a call that waited for a
# slot while the fence moved: one text for one refusal.
STALE_FRAME_MESSAGE = "The frame's connectionGeneration is not the fenced generation."

# --- limits ---
MAX_OUTPUT_PAGE_LENGTH = 65536  # exec.read_output length of a JSON page (§6.3)
# websocket.max_message_bytes' default (§1.4): the largest message the supervisor takes before
# it closes the socket 1009. Defined here, with the wire's other limits, so the daemon's
# configuration and the clients (the TypeScript export) read one value.
DEFAULT_MAX_MESSAGE_BYTES = 131_072
# ... and of a binary page ("format": "binary", §6.5.1): no base64 and no JSON string to
# escape, so a page can be larger without a larger cost per byte; 1 MiB keeps a page
# (and the reply queue's byte budget, session/sender.py) small.
MAX_BINARY_OUTPUT_PAGE_LENGTH = 1024 * 1024
# A binary exec.output_page: a 4-byte big-endian header length, the JSON header, the bytes.
BINARY_PAGE_HEADER_LENGTH_BYTES = 4
OutputPageFormat = Literal["json", "binary"]
# exec.write_stdin: bytes per frame, and the base64 text that carries at most that many.
MAX_STDIN_WRITE_BYTES = 65536
MAX_STDIN_WRITE_CHARS = 4 * -(-MAX_STDIN_WRITE_BYTES // 3)
# FrameError.kind / .reason are for logs: cap what the peer can put there.
MAX_LOGGED_NAME_CHARS = 64
MAX_REASON_CHARS = 200

Signal = Literal["SIGINT", "SIGTERM", "SIGKILL", "SIGHUP"]
BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"

# A client-chosen id on an exec.* request, echoed in the reply's body (§6.3): with several
# reads of one call in flight, or an error that could answer any of them, the id is what
# matches a reply to its request. The characters of a routing id (§2.1), so it needs no
# escaping in logs or JSON; echoed only when given, so clients that send none see nothing new.
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"
REQUEST_ID_FIELD: Final = "request_id"
RequestId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN)
]
_REQUEST_ID_ADAPTER: TypeAdapter[str] = TypeAdapter(RequestId)


def readable_request_id(value: object) -> str | None:
    """`value` when it is a valid request id, else None: what an error about a frame that
    failed its schema may echo (never text the schema refused)."""
    try:
        return _REQUEST_ID_ADAPTER.validate_python(value, strict=True)
    except ValidationError:
        return None


# =============================== client frames ===============================


class AckBody(StrictModel):
    seq: Count  # cumulative; 0 acks nothing


class ExecSignalBody(StrictModel):
    call_id: CallId
    signal: Signal
    request_id: RequestId | None = optional_field()


class ExecReadOutputBody(StrictModel):
    call_id: CallId
    stream: Stream
    offset: Count
    # At most MAX_OUTPUT_PAGE_LENGTH for a JSON page (the validator below).
    length: Annotated[int, Field(ge=1, le=MAX_BINARY_OUTPUT_PAGE_LENGTH)]
    # "binary": the page comes as a binary message (§6.5.1); absent or "json": as JSON.
    format: OutputPageFormat | None = optional_field()
    request_id: RequestId | None = optional_field()

    @property
    def binary(self) -> bool:
        return self.format == "binary"

    @model_validator(mode="after")
    def _json_page_length(self) -> ExecReadOutputBody:
        if not self.binary and self.length > MAX_OUTPUT_PAGE_LENGTH:
            raise ValueError(f"length of a JSON page is at most {MAX_OUTPUT_PAGE_LENGTH}")
        return self


class ExecWriteStdinBody(StrictModel):
    call_id: CallId
    offset: Count  # the stdin offset of data's first byte (§7.7.2)
    data: Annotated[str, StringConstraints(max_length=MAX_STDIN_WRITE_CHARS, pattern=BASE64_PATTERN)]
    request_id: RequestId | None = optional_field()

    @field_validator("data")
    @classmethod
    def _decodable(cls, value: str) -> str:
        # The pattern admits text no decoder takes ("A": bad padding): refused here, as a
        # frame that does not match its schema, not later as an exception.
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("data is not base64") from None
        if len(decoded) > MAX_STDIN_WRITE_BYTES:
            raise ValueError(f"data is over {MAX_STDIN_WRITE_BYTES} bytes")
        return value


class ExecCloseStdinBody(StrictModel):
    call_id: CallId
    offset: Count  # every byte below it must have been written: EOF comes after them
    request_id: RequestId | None = optional_field()


class ExecResizeBody(StrictModel):
    call_id: CallId
    rows: Annotated[int, Field(ge=1, le=MAX_PTY_CELLS)]
    cols: Annotated[int, Field(ge=1, le=MAX_PTY_CELLS)]
    request_id: RequestId | None = optional_field()


class ExecListBody(StrictModel):
    request_id: RequestId | None = optional_field()


class SessionBootstrapFrame(StrictModel):
    kind: Literal["session.bootstrap"]
    connectionGeneration: Generation
    body: BootstrapBody


class ToolCallFrame(StrictModel):
    kind: Literal["tool.call"]
    connectionGeneration: Generation
    # Validated in a second stage by protocol.tools.parse_tool_call: a bad call with a
    # readable call_id is answered by a tool.result for it, not by a frame error.
    body: dict[str, Any]


class EventsAckFrame(StrictModel):
    kind: Literal["events.ack"]
    connectionGeneration: Generation
    body: AckBody


class ExecSignalFrame(StrictModel):
    kind: Literal["exec.signal"]
    connectionGeneration: Generation
    body: ExecSignalBody


class ExecReadOutputFrame(StrictModel):
    kind: Literal["exec.read_output"]
    connectionGeneration: Generation
    body: ExecReadOutputBody


class ExecWriteStdinFrame(StrictModel):
    kind: Literal["exec.write_stdin"]
    connectionGeneration: Generation
    body: ExecWriteStdinBody


class ExecCloseStdinFrame(StrictModel):
    kind: Literal["exec.close_stdin"]
    connectionGeneration: Generation
    body: ExecCloseStdinBody


class ExecResizeFrame(StrictModel):
    kind: Literal["exec.resize"]
    connectionGeneration: Generation
    body: ExecResizeBody


class ExecListFrame(StrictModel):
    kind: Literal["exec.list"]
    connectionGeneration: Generation
    body: ExecListBody


# The exec.* frames that act on or read about processes (the runtime answers them).
ExecFrame = (
    ExecSignalFrame
    | ExecReadOutputFrame
    | ExecWriteStdinFrame
    | ExecCloseStdinFrame
    | ExecResizeFrame
    | ExecListFrame
)

ClientFrameModel = SessionBootstrapFrame | ToolCallFrame | EventsAckFrame | ExecFrame
ClientFrame = Annotated[ClientFrameModel, Field(discriminator="kind")]

# =============================== server frames ===============================


def _kind_required(schema: dict[str, Any]) -> None:
    # `kind` has a default so code can write RuntimeStateFrame(body=…), which would make the
    # exported schema call it optional; on the wire it is always there.
    required = [name for name in schema.get("required", []) if name != "kind"]
    schema["required"] = ["kind", *required]


class ServerFrameBase(StrictModel):
    model_config = ConfigDict(json_schema_extra=_kind_required)


def _exact_int(value: object) -> object:
    # Literal[1] alone accepts true and 1.0 (they compare equal to 1).
    if type(value) is not int:
        raise ValueError("must be the integer 1")
    return value


ProtocolVersion = Annotated[Literal[1], BeforeValidator(_exact_int)]


class RuntimeStateBody(StrictModel):
    status: Literal["ready"]
    sessionId: Id
    generation: Generation
    ackFloor: Count
    localEventMax: Count
    oldestRetainedSeq: Seq  # local_event_max + 1 when nothing is retained
    supervisorVersion: str
    protocolVersion: ProtocolVersion
    scopes: list[Scope]


class RuntimeStateFrame(ServerFrameBase):
    kind: Literal["runtime.state"] = RUNTIME_STATE
    body: RuntimeStateBody


class BootstrapRejectedBody(StrictModel):
    code: str
    message: str


class BootstrapRejectedFrame(ServerFrameBase):
    kind: Literal["session.bootstrap.rejected"] = SESSION_BOOTSTRAP_REJECTED
    body: BootstrapRejectedBody


class ErrorBody(StrictModel):
    code: str
    message: str
    call_id: CallId | None = optional_field()
    request_id: RequestId | None = optional_field()  # the exec.* request's, when it gave one


class ErrorFrame(ServerFrameBase):
    kind: Literal["error"] = ERROR
    body: ErrorBody


class ExecOutputPageBody(StrictModel):
    call_id: CallId
    stream: Stream
    offset: Count
    data: Annotated[str, StringConstraints(pattern=BASE64_PATTERN)]  # the exact bytes, base64
    eof: bool  # the stream has ended and this page reaches its end
    truncated: bool  # the spool hit its cap
    request_id: RequestId | None = optional_field()  # the request's, when it gave one


class ExecOutputPageFrame(ServerFrameBase):
    kind: Literal["exec.output_page"] = EXEC_OUTPUT_PAGE
    body: ExecOutputPageBody


class ExecOutputPageHeaderBody(StrictModel):
    """A binary page's header body (§6.5.1): the JSON page's fields, with the number of
    bytes that follow the header in place of `data`."""

    call_id: CallId
    stream: Stream
    offset: Count
    bytes: Count
    eof: bool
    truncated: bool
    request_id: RequestId | None = optional_field()


class ExecOutputPageHeader(ServerFrameBase):
    kind: Literal["exec.output_page"] = EXEC_OUTPUT_PAGE
    body: ExecOutputPageHeaderBody


def encode_binary_page(body: ExecOutputPageHeaderBody, data: bytes) -> bytes:
    """A binary exec.output_page (§6.5.1): header length, JSON header, the bytes as they are."""
    return b"".join(binary_page_parts(body, data))


def binary_page_parts(body: ExecOutputPageHeaderBody, data: bytes) -> tuple[bytes, bytes]:
    """The same message in two parts, (header length and JSON header, the bytes), for a
    sender that writes them without joining them: a page is up to 1 MiB, and joining means a
    fresh buffer of that size, whose first touch faults every one of its pages in."""
    if body.bytes != len(data):
        raise ValueError("the header's bytes must be the length of the data")
    header = encode_frame(ExecOutputPageHeader(body=body)).encode("utf-8")
    return len(header).to_bytes(BINARY_PAGE_HEADER_LENGTH_BYTES, "big") + header, data


def decode_binary_page(message: bytes) -> tuple[ExecOutputPageHeader, bytes]:
    """The header and the bytes of a binary exec.output_page (for clients and tests); raise
    FrameError when the message is not one."""
    size = int.from_bytes(message[:BINARY_PAGE_HEADER_LENGTH_BYTES], "big")
    end = BINARY_PAGE_HEADER_LENGTH_BYTES + size
    if len(message) < end:
        raise FrameError(INVALID_FRAME, "Binary page shorter than its header length.", kind=EXEC_OUTPUT_PAGE)
    try:
        header = ExecOutputPageHeader.model_validate_json(message[BINARY_PAGE_HEADER_LENGTH_BYTES:end])
    except ValidationError:
        raise FrameError(INVALID_FRAME, "Binary page header does not match its schema.", kind=EXEC_OUTPUT_PAGE) from None
    data = message[end:]
    if len(data) != header.body.bytes:
        raise FrameError(INVALID_FRAME, "Binary page length differs from its header.", kind=EXEC_OUTPUT_PAGE)
    return header, data


class ExecStdinAckBody(StrictModel):
    """The answer to exec.write_stdin and exec.close_stdin (§7.7.2)."""

    call_id: CallId
    offset: Count  # the request's offset
    # The stdin offset after every byte taken (written, or buffered for the process): below `offset` a gap
    # (nothing written: send from here), below offset + the data's length a partial write
    # (the rest was not taken yet: send it again from here).
    next_offset: Count
    closed: bool  # stdin has been closed (EOF)
    request_id: RequestId | None = optional_field()


class ExecStdinAckFrame(ServerFrameBase):
    kind: Literal["exec.stdin_ack"] = EXEC_STDIN_ACK
    body: ExecStdinAckBody


class ProcessExit(StrictModel):
    exit_code: int | None
    signal: str | None
    timed_out: bool


class ProcessInfo(StrictModel):
    """One process of the session in exec.processes (§7.7.4)."""

    call_id: CallId
    tool_name: str
    command: str
    pid: Annotated[int, Field(ge=1)]
    pgid: Annotated[int, Field(ge=1)]
    pty: bool
    started_at: float
    running: bool
    exit: ProcessExit | None  # null while running


class ExecProcessesBody(StrictModel):
    processes: list[ProcessInfo]
    request_id: RequestId | None = optional_field()


class ExecProcessesFrame(ServerFrameBase):
    kind: Literal["exec.processes"] = EXEC_PROCESSES
    body: ExecProcessesBody


# --- journaled events (docs/protocol.md §6.6) ---


class ExecContext(StrictModel):
    """Captured when the process starts and kept with it (docs/protocol.md §6.6)."""

    session_id: Id
    generation: Generation
    idempotency_key: IdempotencyKey | None


class ExecStartedBody(StrictModel):
    call_id: CallId
    pid: Annotated[int, Field(ge=1)]
    pgid: Annotated[int, Field(ge=1)]
    command: str
    cwd: str  # absolute path the command runs in
    started_at: float  # Unix time in seconds
    context: ExecContext


class ExecStartedEvent(ServerFrameBase):
    kind: Literal["exec.started"] = EXEC_STARTED
    seq: Seq
    body: ExecStartedBody


class ExecOutputBody(StrictModel):
    call_id: CallId
    stream: Stream
    text: str  # UTF-8 with replacement of this event's bytes
    offset: Count  # stream offset of the first byte = previous offset + bytes + dropped_bytes
    bytes: Count
    truncated: bool
    dropped_bytes: Count  # dropped from the live buffer since the previous event
    after_exit: bool  # written by a background descendant after the shell exited


class ExecOutputEvent(ServerFrameBase):
    kind: Literal["exec.output"] = EXEC_OUTPUT
    seq: Seq
    body: ExecOutputBody


class ExecCompletedBody(ShellResult):
    call_id: CallId
    interrupted: bool = False  # true when a crash cut the command (§10.2)
    # Present (true) only when the command's memory limit OOM-killed one of its processes
    # (§7.4.3); the tool.result keeps the seed's ShellResult, without it.
    oom_killed: Literal[True] | None = optional_field()


class ExecCompletedEvent(ServerFrameBase):
    kind: Literal["exec.completed"] = EXEC_COMPLETED
    seq: Seq
    body: ExecCompletedBody


class ToolError(BaseModel):
    # The one open model of the protocol: error codes carry their own details next to code
    # and message (current_sha for base_sha_mismatch, hunk for patch_does_not_apply, command
    # for forbidden, output so far for interrupted), and listing them all here would couple
    # this envelope to every tool. Still strict and immutable.
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    code: str
    message: str


class ToolResultBody(StrictModel):
    call_id: CallId
    idempotency_key: IdempotencyKey | None
    tool_name: str | None  # as the caller sent it; None when it was not a readable string
    ok: bool
    result: dict[str, Any] | None = optional_field()
    error: ToolError | None = optional_field()

    @model_validator(mode="after")
    def _exactly_one_outcome(self) -> ToolResultBody:
        if self.ok and (self.result is None or self.error is not None):
            raise ValueError("ok:true needs result and no error")
        if not self.ok and (self.error is None or self.result is not None):
            raise ValueError("ok:false needs error and no result")
        return self


class ToolResultEvent(ServerFrameBase):
    kind: Literal["tool.result"] = TOOL_RESULT
    seq: Seq
    body: ToolResultBody


class EventWithheldBody(StrictModel):
    """Empty on purpose: nothing of the withheld event is told, not even its kind."""


_WITHHELD_BODY = EventWithheldBody()


class EventWithheldEvent(ServerFrameBase):
    kind: Literal["event.withheld"] = EVENT_WITHHELD
    seq: Seq
    body: EventWithheldBody


def encode_withheld(seq: int) -> str:
    """The placeholder a socket gets for event `seq` outside its view (§9.1)."""
    return encode_frame(EventWithheldEvent(seq=seq, body=_WITHHELD_BODY))


class ToolPendingBody(StrictModel):
    call_id: CallId  # the retry's call_id
    idempotency_key: IdempotencyKey


class ToolPendingFrame(ServerFrameBase):
    kind: Literal["tool.pending"] = TOOL_PENDING
    body: ToolPendingBody


class ToolReplayedBody(StrictModel):
    call_id: CallId  # the retry's call_id
    idempotency_key: IdempotencyKey
    original: ToolResultEvent  # the earlier tool.result event as journaled (same seq)


class ToolReplayedFrame(ServerFrameBase):
    kind: Literal["tool.replayed"] = TOOL_REPLAYED
    body: ToolReplayedBody


ServerFrameModel = (
    RuntimeStateFrame
    | BootstrapRejectedFrame
    | ToolPendingFrame
    | ToolReplayedFrame
    | ExecOutputPageFrame
    | ExecStdinAckFrame
    | ExecProcessesFrame
    | ErrorFrame
    | ExecStartedEvent
    | ExecOutputEvent
    | ExecCompletedEvent
    | ToolResultEvent
    | EventWithheldEvent
)
ServerFrame = Annotated[ServerFrameModel, Field(discriminator="kind")]

# =============================== decode / encode ===============================


class FrameError(ValueError):
    """A frame that does not decode.

    `code`: UNKNOWN_KIND (a JSON object whose string `kind` is not one we know) or
    INVALID_FRAME (anything else). `message` is one sentence safe to send to the peer: it
    echoes nothing the peer sent except a kind name we know. `kind` and `reason` are for
    logs. `call_id` is the body's call_id when it is a readable uuid, so the error frame can
    name the call; `request_id` the body's request id when it is a valid one, so that a
    client can match the error to its request.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        kind: str | None = None,
        call_id: str | None = None,
        request_id: str | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind
        self.call_id = call_id
        self.request_id = request_id
        self.reason = reason


_CLIENT_FRAME_ADAPTER: TypeAdapter[ClientFrameModel] = TypeAdapter(ClientFrame)
_SERVER_FRAME_ADAPTER: TypeAdapter[ServerFrameModel] = TypeAdapter(ServerFrame)
_Frame = TypeVar("_Frame", bound=BaseModel)


def _first_problem(error: ValidationError) -> str:
    first = error.errors(include_url=False, include_input=False, include_context=False)[0]
    where = ".".join(str(part)[:MAX_LOGGED_NAME_CHARS] for part in first["loc"])
    return f"{first['type']} at {where or '<root>'}"[:MAX_REASON_CHARS]


def _frame_error(raw: str | bytes, known_kinds: frozenset[str], reason: str) -> FrameError:
    """Classify a frame that failed validation (the slow path: a second parse)."""
    try:
        document = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return FrameError(INVALID_FRAME, "Frame is not valid JSON.", reason=reason)
    if not isinstance(document, dict):
        return FrameError(INVALID_FRAME, "Frame is not a JSON object.", reason=reason)
    kind = document.get("kind")
    if not isinstance(kind, str):
        return FrameError(INVALID_FRAME, "Frame has no string kind.", reason=reason)
    body = document.get("body")
    call_id = body.get("call_id") if isinstance(body, dict) else None
    readable_call_id = call_id if is_call_id(call_id) else None
    request_id = readable_request_id(body.get(REQUEST_ID_FIELD)) if isinstance(body, dict) else None
    if kind not in known_kinds:
        return FrameError(
            UNKNOWN_KIND,
            "Frame kind is not known.",
            kind=kind[:MAX_LOGGED_NAME_CHARS],
            call_id=readable_call_id,
            request_id=request_id,
            reason=reason,
        )
    return FrameError(
        INVALID_FRAME,
        f"Frame does not match the {kind} schema.",
        kind=kind,
        call_id=readable_call_id,
        # Only a kind that carries request ids echoes one (a tool.call's error is matched by
        # its call_id). An unknown kind echoes it above: a client may have sent a newer exec.*
        # kind than this daemon knows, and must still match the refusal to its request.
        request_id=request_id if kind in REQUEST_ID_KINDS else None,
        reason=reason,
    )


def _decode(
    adapter: TypeAdapter[_Frame], known_kinds: frozenset[str], raw: str | bytes
) -> _Frame:
    try:
        return adapter.validate_json(raw)
    except ValidationError as error:
        raise _frame_error(raw, known_kinds, _first_problem(error)) from None
    except (ValueError, TypeError, RecursionError) as error:
        # Not expected from validate_json; kept so that the promise "only FrameError" holds.
        raise _frame_error(raw, known_kinds, type(error).__name__) from None


def decode_client_frame(raw: str | bytes) -> ClientFrameModel:
    """Decode one client message into its frame model; raise only FrameError."""
    return _decode(_CLIENT_FRAME_ADAPTER, CLIENT_KINDS, raw)


def decode_server_frame(raw: str | bytes) -> ServerFrameModel:
    """Decode one server message (for clients and tests); raise only FrameError."""
    return _decode(_SERVER_FRAME_ADAPTER, SERVER_KINDS, raw)


def encode_frame(frame: BaseModel) -> str:
    """The one encoder of server frames: compact JSON (no spaces), keys in field order,
    optional fields omitted when absent, non-ASCII as UTF-8."""
    return frame.model_dump_json(by_alias=True)


_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


def _count(value: object) -> bool:
    """What `Count` accepts, for the direct encoders (strict: an int, not a bool)."""
    return type(value) is int and 0 <= value <= MAX_SAFE_INTEGER


def encode_stdin_ack(call_id: str, offset: int, next_offset: int, closed: bool, request_id: str | None) -> str:
    """exec.stdin_ack, one per keystroke of a terminal: written directly, byte for byte what
    `encode_frame(ExecStdinAckFrame(...))` gives (tests/test_frames_direct.py holds this), at a
    fraction of a model's validation and dump. The model stays the schema: the values are
    checked as it checks them (its patterns admit no character JSON escapes), and anything
    the check does not pass goes through the model, which encodes it or raises as before."""
    if (
        type(call_id) is str  # not a subclass: its own formatting could differ from the model's
        and is_call_id(call_id)
        and _count(offset)
        and _count(next_offset)
        and type(closed) is bool
        and (
            request_id is None
            or (
                type(request_id) is str
                and len(request_id) <= MAX_REQUEST_ID_CHARS
                and _REQUEST_ID_RE.fullmatch(request_id) is not None
            )
        )
    ):
        tail = "}}" if request_id is None else f',"request_id":"{request_id}"}}}}'
        return (
            f'{{"kind":"{EXEC_STDIN_ACK}","body":{{"call_id":"{call_id}","offset":{offset},'
            f'"next_offset":{next_offset},"closed":{"true" if closed else "false"}{tail}'
        )
    body = {"call_id": call_id, "offset": offset, "next_offset": next_offset, "closed": closed, "request_id": request_id}
    return encode_frame(ExecStdinAckFrame(body=ExecStdinAckBody.model_validate(body)))


EVENT_MODELS: dict[str, type[ExecStartedEvent | ExecOutputEvent | ExecCompletedEvent | ToolResultEvent]] = {
    EXEC_STARTED: ExecStartedEvent,
    EXEC_OUTPUT: ExecOutputEvent,
    EXEC_COMPLETED: ExecCompletedEvent,
    TOOL_RESULT: ToolResultEvent,
}


# exec.output's body members, in the model's field order (the order they are written in).
_OUTPUT_MEMBERS: Final = tuple(ExecOutputBody.model_fields)
_OUTPUT_MEMBER_SET: Final = frozenset(_OUTPUT_MEMBERS)
# The JSON string of a `str` exactly as `encode_frame` writes it: non-ASCII as UTF-8 and
# the same escapes (the C encoder of `json.dumps(..., ensure_ascii=False)`).
_json_string: Final = encode_basestring


def _exec_output_direct(seq: object, body: Mapping[str, Any]) -> str | None:
    """exec.output, one per terminal echo, written directly: byte for byte what
    `encode_frame(ExecOutputEvent.model_validate(...))` gives (tests/test_frames_direct.py
    holds this over every character class JSON treats apart), at a fraction of the model's
    validation and dump. None for anything the checks below do not pass exactly as the model
    would (the caller then goes through the model, which encodes it or raises as before): a
    member missing or extra, a value of another type (strict: a bool is not a count, a str
    subclass is not taken here), a count out of range, a call id off its pattern, and a text
    UTF-8 cannot encode (a lone surrogate, which the model refuses when it writes JSON)."""
    if type(body) is not dict or body.keys() != _OUTPUT_MEMBER_SET:
        return None
    call_id, stream, text = body["call_id"], body["stream"], body["text"]
    truncated, after_exit = body["truncated"], body["after_exit"]
    if not (
        type(seq) is int
        and 1 <= seq <= MAX_SAFE_INTEGER
        and type(call_id) is str
        and is_call_id(call_id)
        and type(stream) is str
        and stream in STREAMS
        and type(text) is str
        and _count(body["offset"])
        and _count(body["bytes"])
        and type(truncated) is bool
        and _count(body["dropped_bytes"])
        and type(after_exit) is bool
    ):
        return None
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None
    return (
        f'{{"kind":"{EXEC_OUTPUT}","seq":{seq},"body":{{"call_id":"{call_id}","stream":"{stream}",'
        f'"text":{_json_string(text)},"offset":{body["offset"]},"bytes":{body["bytes"]},'
        f'"truncated":{"true" if truncated else "false"},"dropped_bytes":{body["dropped_bytes"]},'
        f'"after_exit":{"true" if after_exit else "false"}}}}}'
    )


def encode_event(kind: str, seq: int, body: Mapping[str, Any]) -> str:
    """A journaled event exactly as it is stored and sent: validated against its model (so
    nothing malformed is ever journaled) and written by `encode_frame`. ValueError (pydantic's
    ValidationError is one) for an unknown kind or a body that does not fit. exec.output, the
    event of every keystroke's echo, is written directly when its values pass the model's
    checks (`_exec_output_direct`), the same bytes."""
    if kind == EXEC_OUTPUT:
        direct = _exec_output_direct(seq, body)
        if direct is not None:
            return direct
    model = EVENT_MODELS.get(kind)
    if model is None:
        raise ValueError(f"not a journaled event kind: {kind!r}")
    return encode_frame(model.model_validate({"kind": kind, "seq": seq, "body": body}))


def encode_replayed(call_id: str, idempotency_key: str, original: str) -> str:
    """tool.replayed for a retry, embedding the journaled tool.result `original`. Re-encoded
    by the one encoder, it is byte for byte the text that was journaled (that text came from
    the same encoder: a test holds this)."""
    event = ToolResultEvent.model_validate_json(original)
    return encode_frame(
        ToolReplayedFrame(body=ToolReplayedBody(call_id=call_id, idempotency_key=idempotency_key, original=event))
    )
