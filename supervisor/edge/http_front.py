"""The plain-HTTP side of a listener, as pure functions over values.

trio-websocket answers any non-upgrade request with an empty 400 before application code runs,
so the daemon reads every request head itself (with h11), answers health, 404 and 426 here,
and hands only well-formed WebSocket upgrades of the control path to trio-websocket.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus

import h11

from sandbox_supervisor.protocol import errors

# A routing head with an assertion is ~2 KiB; 16 KiB leaves room for proxies' extra headers
# while bounding what a slow or hostile peer can make us buffer before it is authenticated.
MAX_REQUEST_HEAD_BYTES = 16 * 1024
WEBSOCKET_VERSION = b"13"
# The text format prometheus_client's generate_latest writes. prometheus_client >= 0.22 calls
# "latest" its 1.0.0 format; with our names (plain ASCII) both are the same bytes, and 0.0.4
# is what every scraper accepts.
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class Route(enum.Enum):
    HEALTH = "health"
    READY = "ready"
    METRICS = "metrics"
    CONTROL_UPGRADE = "control_upgrade"
    # An upgrade of the control path whose framing is ambiguous (a body, or bare-LF lines):
    # refused 400 before the gate, so it records nothing.
    BAD_UPGRADE = "bad_upgrade"
    UPGRADE_REQUIRED = "upgrade_required"
    NOT_FOUND = "not_found"


@dataclass(frozen=True, slots=True)
class RoutePaths:
    """The paths a listener serves; a None path is a plain 404 there."""

    control: str | None  # None on the metrics-only listener (websocket.metrics_listen)
    health: str | None
    metrics: str | None  # None while metrics are disabled, or served on their own listener
    ready: str | None = None


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: bytes
    path: str  # the target without its query string
    headers: list[tuple[bytes, bytes]]  # lower-cased names, as h11 gives them
    http_version: bytes = b"1.1"
    # Some line of the head ended in a bare LF instead of CRLF. h11 accepts both and hands
    # over the same headers either way, so only the raw bytes the HeadReader kept tell.
    bare_lf: bool = False


class HeadTooLarge(Exception):
    """The request head grew past MAX_REQUEST_HEAD_BYTES."""


class MalformedHead(Exception):
    """The bytes are not an HTTP/1.1 request head (or the peer closed mid-head)."""


class HeadReader:
    """Feeds bytes to h11 until a request head is complete; no I/O of its own.

    Keeps every byte it was given so that an upgrade can be replayed to wsproto verbatim,
    and reports the bytes that followed the head (a pipelining client's first frame).
    """

    def __init__(self, max_bytes: int = MAX_REQUEST_HEAD_BYTES) -> None:
        self._max_bytes = max_bytes
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> RequestHead | None:
        """Add received bytes (b"" at EOF); return the head once complete."""
        self._chunks.append(data)
        self._size += len(data)
        self._conn.receive_data(data)
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431 or self._size > self._max_bytes:
                raise HeadTooLarge() from None
            # h11 quotes the offending bytes after a colon ("illegal header line:
            # bytearray(b'…')"), and those bytes may be an assertion: keep only the category.
            raise MalformedHead(str(exc).split(":", 1)[0]) from None
        if event is h11.NEED_DATA:
            if not data:
                raise MalformedHead("connection closed before the request head was complete")
            if self._size > self._max_bytes:
                raise HeadTooLarge()
            return None
        if not isinstance(event, h11.Request):
            raise MalformedHead(f"unexpected event {type(event).__name__}")
        head_len = self._size - len(self.trailing)
        # h11's own cap applies to incomplete events only, so a head that arrived in one large
        # chunk passes it: check the size of the parsed head again.
        if head_len > self._max_bytes:
            raise HeadTooLarge()
        target = event.target.split(b"?", 1)[0]
        return RequestHead(
            method=event.method,
            path=target.decode("ascii", errors="replace"),
            headers=[(name.lower(), value) for name, value in event.headers],
            http_version=event.http_version,
            bare_lf=has_bare_lf(self.head_bytes),
        )

    @property
    def raw(self) -> bytes:
        return b"".join(self._chunks)

    @property
    def trailing(self) -> bytes:
        return self._conn.trailing_data[0]

    @property
    def head_bytes(self) -> bytes:
        raw = self.raw
        return raw[: len(raw) - len(self.trailing)]


def has_bare_lf(head_bytes: bytes) -> bool:
    """True when some LF in the head is not preceded by CR (RFC 9112 2.2 tolerates it; an
    intermediary that does not may see other header lines than we do)."""
    return head_bytes.count(b"\n") != head_bytes.count(b"\r\n")


def _header_values(head: RequestHead, name: bytes) -> list[bytes]:
    return [value for key, value in head.headers if key == name]


def websocket_key(head: RequestHead) -> bytes:
    """The `Sec-WebSocket-Key` of a head that `is_valid_websocket_handshake` passed (exactly
    one, ASCII, not empty), as h11 parsed it: what the 101's accept token is made from."""
    (key,) = _header_values(head, b"sec-websocket-key")
    return key


def _tokens(values: list[bytes]) -> set[bytes]:
    return {token.strip().lower() for value in values for token in value.split(b",")}


def is_websocket_upgrade(head: RequestHead) -> bool:
    """True when the head asks for a WebSocket upgrade at all (Upgrade: websocket)."""
    return b"websocket" in _tokens(_header_values(head, b"upgrade"))


def _ascii(value: bytes) -> bool:
    return value.isascii()


def _idna(value: bytes) -> bool:
    try:
        value.decode("idna")
    except UnicodeError:
        return False
    return True


def is_valid_websocket_handshake(head: RequestHead) -> bool:
    """Everything wsproto will insist on (and every header it decodes), checked first.

    The fence is recorded before the handshake is handed to wsproto, so a request wsproto
    would refuse (with its own bare 400) must never get that far: such a refusal would have
    moved the fence for nothing.
    """
    def single(name: bytes) -> bytes | None:
        values = _header_values(head, name)
        return values[0] if len(values) == 1 else None

    host = single(b"host")
    upgrade = single(b"upgrade")
    connection = single(b"connection")
    key = single(b"sec-websocket-key")
    decoded = [
        value
        for name in (b"sec-websocket-extensions", b"sec-websocket-protocol")
        for value in _header_values(head, name)
    ]
    return (
        head.method == b"GET"
        and head.http_version == b"1.1"
        and host is not None
        and _idna(host)
        and upgrade is not None
        and upgrade.strip().lower() == b"websocket"
        and connection is not None
        and _ascii(connection)
        and b"upgrade" in _tokens([connection])
        and single(b"sec-websocket-version") == WEBSOCKET_VERSION
        and key is not None
        and _ascii(key)
        and bool(key.strip())
        and all(_ascii(value) for value in decoded)
        # Not wsproto's check but ours: see upgrade_framing_defect.
        and upgrade_framing_defect(head) is None
    )


def upgrade_framing_defect(head: RequestHead) -> str | None:
    """Why an upgrade request's framing is refused (400), or None when it is sound.

    An upgrade carries no body: whatever a body would hold is replayed to the WebSocket
    library after the head and read as the peer's first frames, bytes that a proxy in front
    of us framed as HTTP body and never inspected as WebSocket input (request smuggling).
    So any `Transfer-Encoding`, and any `Content-Length` other than 0, is refused;
    `Content-Length: 0` announces no body and is harmless, so it is allowed. Bare-LF line
    endings are refused for the same reason: an intermediary that splits lines only on
    CRLF reads other headers than we do.
    """
    if head.bare_lf:
        return "bare LF line ending in the request head"
    if _header_values(head, b"transfer-encoding"):
        return "transfer-encoding on an upgrade request"
    # h11 has already refused a Content-Length that is not a number, or two that differ.
    if any(value.strip() != b"0" for value in _header_values(head, b"content-length")):
        return "request body on an upgrade request"
    return None


def classify(head: RequestHead, paths: RoutePaths) -> Route:
    if head.method == b"GET" and head.path in (paths.health, paths.ready) and not is_websocket_upgrade(head):
        return Route.HEALTH if head.path == paths.health else Route.READY
    if paths.metrics is not None and head.method == b"GET" and head.path == paths.metrics:
        return Route.METRICS
    if paths.control is not None and head.method == b"GET" and head.path == paths.control:
        if is_websocket_upgrade(head) and upgrade_framing_defect(head) is not None:
            return Route.BAD_UPGRADE
        if is_valid_websocket_handshake(head):
            return Route.CONTROL_UPGRADE
        return Route.UPGRADE_REQUIRED
    return Route.NOT_FOUND


def render_response(
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> bytes:
    reason = HTTPStatus(status).phrase.encode("ascii")
    lines = [
        b"HTTP/1.1 %d %s" % (status, reason),
        b"content-type: " + content_type,
        b"content-length: %d" % len(body),
        b"cache-control: no-store",
        b"connection: close",
    ]
    lines.extend(name + b": " + value for name, value in extra_headers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def json_body(payload: Mapping[str, object]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def render_error(
    status: int, code: str, message: str, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    return render_response(
        status, json_body({"error": code, "message": message}), extra_headers=extra_headers
    )


def render_refusal(code: str, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """The HTTP answer of one refusal code, as protocol.errors.HTTP_ERRORS defines it."""
    status, message = errors.HTTP_ERRORS[code]
    return render_error(status, code, message, extra_headers)


NOT_FOUND_RESPONSE = render_refusal(errors.NOT_FOUND_ROUTE)
UPGRADE_REQUIRED_RESPONSE = render_refusal(
    errors.UPGRADE_REQUIRED,
    extra_headers=[(b"upgrade", b"websocket"), (b"sec-websocket-version", WEBSOCKET_VERSION)],
)
TOO_MANY_HANDSHAKES_RESPONSE = render_refusal(errors.TOO_MANY_HANDSHAKES)
HEAD_TOO_LARGE_RESPONSE = render_refusal(errors.REQUEST_HEAD_TOO_LARGE)
BAD_REQUEST_RESPONSE = render_refusal(errors.BAD_REQUEST)
