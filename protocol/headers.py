"""Routing headers of the upgrade request (docs/protocol.md §2.1) and their parsing.

The gate calls `parse_routing_headers` at step 2 with the header list h11 produced. It is
pure and total: whatever the peer sent, the only exception it raises is
`RoutingHeaderError`, which the gate maps to `400 invalid_routing_headers`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SANDBOX_ID_HEADER = "e2b-sandbox-id"
SESSION_ID_HEADER = "x-coding-agent-session-id"
SESSION_SANDBOX_ID_HEADER = "x-coding-agent-session-sandbox-id"
ATTEMPT_ID_HEADER = "x-coding-agent-runtime-connection-attempt-id"
GENERATION_HEADER = "x-coding-agent-connection-generation"
EVENT_ACK_HEADER = "x-coding-agent-event-ack"
AUTHORITY_HEADER = "x-coding-agent-control-authority"

# The largest integer every JSON implementation (notably JavaScript's) represents exactly;
# generations and seqs travel in JSON, so they must stay below it.
MAX_SAFE_INTEGER = 2**53 - 1
ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

# 2^53-1 has 16 digits; the spec allows leading zeros ("01" is 1), so leave room for some,
# but cap the length before int() so a megabyte of digits costs nothing.
MAX_NUMBER_CHARS = 32

# fullmatch: with re.match, "$" would also match before a trailing newline.
_ID_RE = re.compile(ID_PATTERN)
_DIGITS_RE = re.compile(r"[0-9]+")

_ID_HEADERS = (SANDBOX_ID_HEADER, SESSION_ID_HEADER, SESSION_SANDBOX_ID_HEADER, ATTEMPT_ID_HEADER)
_NUMBER_HEADERS = (GENERATION_HEADER, EVENT_ACK_HEADER)
ROUTING_HEADERS = (*_ID_HEADERS, *_NUMBER_HEADERS, AUTHORITY_HEADER)
_ROUTING_HEADER_BYTES = {name.encode("ascii"): name for name in ROUTING_HEADERS}


@dataclass(frozen=True, slots=True)
class RoutingHeaders:
    sandbox_id: str
    session_id: str
    session_sandbox_id: str
    attempt_id: str
    generation: int  # 1..MAX_SAFE_INTEGER
    event_ack: int  # 0..MAX_SAFE_INTEGER
    # None when the header is absent: the gate answers that with 401 at step 5, not 400 here.
    authority: str | None


class RoutingHeaderError(ValueError):
    """A routing header is missing or malformed; `.reason` is short text for logs."""

    def __init__(self, header: str, reason: str) -> None:
        super().__init__(f"{header}: {reason}")
        self.header = header
        self.reason = reason


def _as_bytes(value: object) -> bytes | None:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        # Callers other than h11 may hand us str; non-ASCII is caught by the value check.
        return value.encode("utf-8", "surrogatepass")
    return None


def _collect(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    try:
        entries = iter(headers)
    except TypeError:
        raise RoutingHeaderError("*", "headers are not iterable") from None
    for entry in entries:
        try:
            raw_name, raw_value = entry
        except (TypeError, ValueError):
            raise RoutingHeaderError("*", "header entry is not a (name, value) pair") from None
        name_bytes, value = _as_bytes(raw_name), _as_bytes(raw_value)
        if name_bytes is None or value is None:
            raise RoutingHeaderError("*", "header entry is not bytes")
        name = _ROUTING_HEADER_BYTES.get(name_bytes.lower())
        if name is None:
            continue  # not ours: other headers are ignored
        if name in found:
            # Two values could be read differently by a proxy and by us; refuse both.
            raise RoutingHeaderError(name, "duplicate")
        found[name] = value
    return found


def _ascii(name: str, value: bytes) -> str:
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        raise RoutingHeaderError(name, "not ascii") from None


def _parse_id(name: str, found: dict[str, bytes]) -> str:
    if name not in found:
        raise RoutingHeaderError(name, "missing")
    text = _ascii(name, found[name])
    if _ID_RE.fullmatch(text) is None:
        raise RoutingHeaderError(name, "not an id")
    return text


def _parse_number(name: str, found: dict[str, bytes], minimum: int) -> int:
    if name not in found:
        raise RoutingHeaderError(name, "missing")
    text = _ascii(name, found[name])
    if len(text) > MAX_NUMBER_CHARS:
        raise RoutingHeaderError(name, "too long")
    # Digits only: int() alone would accept "+1", " 1", "1_0" and non-ASCII digits.
    if _DIGITS_RE.fullmatch(text) is None:
        raise RoutingHeaderError(name, "not decimal digits")
    number = int(text)
    if number < minimum:
        raise RoutingHeaderError(name, f"below {minimum}")
    if number > MAX_SAFE_INTEGER:
        raise RoutingHeaderError(name, "above 2^53-1")
    return number


def parse_routing_headers(headers: Iterable[tuple[bytes, bytes]]) -> RoutingHeaders:
    """Read the routing headers from (name, value) pairs; raise only RoutingHeaderError."""
    found = _collect(headers)
    sandbox_id, session_id, session_sandbox_id, attempt_id = (
        _parse_id(name, found) for name in _ID_HEADERS
    )
    generation = _parse_number(GENERATION_HEADER, found, minimum=1)
    event_ack = _parse_number(EVENT_ACK_HEADER, found, minimum=0)
    authority_raw = found.get(AUTHORITY_HEADER)
    # Never 400 for the assertion's content: a bad value (empty, non-ASCII) is an invalid
    # assertion, answered 401 at step 5. latin-1 maps every byte, so decoding cannot fail.
    authority = None if authority_raw is None else authority_raw.decode("latin-1")
    return RoutingHeaders(
        sandbox_id=sandbox_id,
        session_id=session_id,
        session_sandbox_id=session_sandbox_id,
        attempt_id=attempt_id,
        generation=generation,
        event_ack=event_ack,
        authority=authority,
    )
