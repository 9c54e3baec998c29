"""The handshake check agrees with wsproto, the library that completes the handshake.

The daemon reads the request head itself, runs the gate (which records the fence) and only
then replays the same bytes to trio-websocket, whose wsproto `H11Handshake` answers the
101. `http_front.is_valid_websocket_handshake` exists so that the fence is never recorded
for a request wsproto would then refuse. So, for every request head:

    our check says valid  ==>  wsproto yields a `Request` event (no RejectConnection, no
                               exception) and sends its 101 for it.

The converse holds too, except where we are deliberately stricter than wsproto; each such
case is one of STRICTER_THAN_WSPROTO below, and the property asserts that every
disagreement is one of them and nothing else.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from wsproto.connection import ConnectionType
from wsproto.events import AcceptConnection, Request
from wsproto.handshake import H11Handshake

from sandbox_supervisor.daemon.edge.http_front import (
    HeadReader,
    MAX_REQUEST_HEAD_BYTES,
    HeadTooLarge,
    MalformedHead,
    RequestHead,
    upgrade_framing_defect,
    Route,
    RoutePaths,
    classify,
    is_valid_websocket_handshake,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings

PATHS = RoutePaths(control="/v1/control", health="/healthz", metrics="/metrics")
KEY = base64.b64encode(b"0123456789abcdef")


def wsproto_accepts(raw: bytes) -> bool:
    """What trio-websocket's handshake does with these bytes: a Request event, then a 101."""
    handshake = H11Handshake(ConnectionType.SERVER)
    try:
        handshake.receive_data(raw)
        events = list(handshake.events())
        if not (events and isinstance(events[0], Request)):
            return False
        handshake.send(AcceptConnection())
    except Exception:  # RemoteProtocolError, and the UnicodeErrors of its header decoding
        return False
    return True


def our_head(raw: bytes) -> RequestHead | HeadTooLarge | None:
    """The head as the daemon reads it; HeadTooLarge, or None for bytes that are no head."""
    reader = HeadReader()
    try:
        return reader.feed(raw) or reader.feed(b"")
    except HeadTooLarge as refusal:
        return refusal
    except MalformedHead:
        return None


def _values(head: RequestHead, name: bytes) -> list[bytes]:
    return [value for key, value in head.headers if key == name]


def _key_is_not_a_nonce(head: RequestHead) -> bool:
    # RFC 6455 4.1: the key is a base64 nonce, so ASCII and not empty. wsproto takes any
    # bytes and answers with the hash of whatever it got.
    keys = _values(head, b"sec-websocket-key")
    return any(not key.isascii() or not key.strip() for key in keys)


def _upgrade_token_only_after_str_strip(head: RequestHead) -> bool:
    # wsproto decodes Connection and strips each token with str.strip(), which also strips
    # the C0 separators \x1c-\x1f ("Upgrade\x1c" becomes "Upgrade"). HTTP's optional
    # whitespace is only space and tab, so a proxy reads another token than wsproto does;
    # we strip as HTTP does and refuse.
    for value in _values(head, b"connection"):
        if value.isascii():
            for token in value.split(b","):
                if token.decode("ascii").strip().lower() == "upgrade" and token.strip(b" \t").lower() != b"upgrade":
                    return True
    return False


# Deliberate strictness: requests wsproto would accept that the daemon refuses (426 before
# the gate, or 431 for the size). Each names why refusing is right.
STRICTER_THAN_WSPROTO: dict[str, Callable[[RequestHead], bool]] = {
    # RFC 6455 4.1 requires HTTP/1.1 or higher; wsproto never looks at the version.
    "http/1.0": lambda head: head.http_version != b"1.1",
    # Two values of one handshake header could be read differently by a proxy in front of
    # us and by wsproto (which silently keeps the last one): refuse both, as the routing
    # headers do.
    "duplicate header": lambda head: any(
        len(_values(head, name)) > 1
        for name in (b"upgrade", b"connection", b"sec-websocket-key", b"sec-websocket-version")
    ),
    "key not a nonce": _key_is_not_a_nonce,
    "control byte around the upgrade token": _upgrade_token_only_after_str_strip,
    # A body (Transfer-Encoding, Content-Length other than 0) would be replayed to wsproto
    # as the first frames, bytes a proxy framed as HTTP body; bare-LF lines may be split
    # differently by an intermediary. wsproto (h11) takes both; we answer 400.
    "ambiguous framing": lambda head: upgrade_framing_defect(head) is not None,
}
# The head is over MAX_REQUEST_HEAD_BYTES: h11 (and so wsproto) caps only a head that is
# still incomplete, so one that arrives whole in a single read passes it; we cap every head.
HEAD_TOO_LARGE = "head too large"


def stricter_reasons(head: RequestHead | HeadTooLarge) -> list[str]:
    if isinstance(head, HeadTooLarge):
        return [HEAD_TOO_LARGE]
    return [name for name, applies in STRICTER_THAN_WSPROTO.items() if applies(head)]


def agreement(raw: bytes) -> str:
    """Assert the property for one request; name the outcome."""
    theirs = wsproto_accepts(raw)
    head = our_head(raw)
    ours = isinstance(head, RequestHead) and is_valid_websocket_handshake(head)
    if isinstance(head, RequestHead):
        # Only a valid handshake on the control path is routed to the gate (and the fence).
        on_control_path = head.method == b"GET" and head.path == PATHS.control
        assert (classify(head, PATHS) is Route.CONTROL_UPGRADE) is (ours and on_control_path)
    if ours:
        assert theirs, "we would record the fence for a handshake wsproto refuses"
        return "both accept"
    if theirs:
        assert head is not None, "a head wsproto parsed, our reader refused"
        reasons = stricter_reasons(head)
        assert reasons, "we refuse a handshake wsproto accepts, for no documented reason"
        return f"stricter: {reasons[0]}"
    return "both refuse"


# --- request heads ------------------------------------------------------------------------

NON_ASCII = [b"\xc3\xa9", b"caf\xc3\xa9", b"\xff", b"\x80abc"]
CONTROL = [b"\x01", b"\x1c", b"\x1f", b"\x7f", b"\x0b"]
WHITESPACE = [b" ", b"\t"]


# Per header: plausible values, then odd ones (each list's first value is the one a valid
# request is built from).
GOOD: dict[bytes, list[bytes]] = {
    b"host": [b"localhost", b"127.0.0.1:8787", b"[::1]:8787", b"sandbox.example", b"xn--nxasmq6b.example"],
    b"upgrade": [b"websocket", b"WebSocket", b"WEBSOCKET"],
    b"connection": [b"Upgrade", b"upgrade", b"keep-alive, Upgrade", b"Upgrade, keep-alive", b"keep-alive,upgrade"],
    b"sec-websocket-key": [KEY, b"dGhlIHNhbXBsZSBub25jZQ=="],
    b"sec-websocket-version": [b"13"],
    b"sec-websocket-extensions": [b"permessage-deflate", b"permessage-deflate; client_max_window_bits", b"x-a, x-b"],
    b"sec-websocket-protocol": [b"chat", b"chat, superchat"],
    b"origin": [b"https://control-plane.example"],
    b"x-coding-agent-session-id": [b"session-1"],
}
ODD: dict[bytes, list[bytes]] = {
    b"host": [b"", b"xn--", b"xn--zz", b"a..b", b"-leading", b"x" * 64 + b".example", b"\xc3\xa9.example"],
    b"upgrade": [b"", b"websocket, h2c", b"h2c", b"websockets", b"web socket", b"websocket/13", b"websocket\x1c"],
    b"connection": [b"", b"keep-alive", b"close", b"upgraded", b"up grade", b",", b"keep-alive, ,Upgrade", b"Upgrade\x1c"],
    b"sec-websocket-key": [b"", b"abc", b"not base64!", b"=" * 24, b"\x01"],
    b"sec-websocket-version": [b"", b"12", b"013", b"13, 8", b"14", b"8", b"13\x1c"],
    b"sec-websocket-extensions": [b"", b",", b";;"],
    b"sec-websocket-protocol": [b"", b",", b"a b"],
    b"origin": [b"null"],
    b"x-coding-agent-session-id": [b""],
}


def odd_values(name: bytes) -> list[bytes]:
    """Every defect the tests try on one header."""
    good = GOOD[name]
    return (
        ODD[name]
        + NON_ASCII
        + [good[0] + suffix for suffix in NON_ASCII + CONTROL]
        + [space + value + space for value in good for space in WHITESPACE]
        + good[1:]
    )


def _variants(name: bytes) -> st.SearchStrategy[bytes]:
    """Mostly the plausible value (so that most heads are one defect away from valid), else
    a defect, or arbitrary bytes."""
    # Any byte but CR, LF and NUL: h11 takes control bytes inside a value, refuses others.
    legal = st.binary(max_size=24).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00"))
    return st.integers(0, 9).flatmap(
        lambda pick: st.sampled_from(GOOD[name]) if pick <= 5 else st.sampled_from(odd_values(name)) if pick <= 8 else legal
    )


HEADER_VALUES = {name: _variants(name) for name in GOOD}
# Names as sent: the canonical capitalisation, lower case, and an odd one.
SPELLINGS = st.sampled_from([bytes.title, bytes.lower, bytes.upper])


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET"] * 7 + [b"get", b"POST", b"HEAD"]))
    target = draw(st.sampled_from([b"/v1/control", b"/v1/control", b"/v1/control?a=1", b"/healthz", b"/other"]))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 7 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.10"]))
    headers: list[tuple[bytes, bytes]] = []
    for name, values in HEADER_VALUES.items():
        # Usually once, sometimes absent, sometimes twice (a duplicate).
        count = draw(st.sampled_from([1] * 16 + [0, 2]))
        spell = draw(SPELLINGS)
        headers += [(spell(name), draw(values)) for _ in range(count)]
    if draw(st.integers(0, 19)) == 0:  # now and then, a head over MAX_REQUEST_HEAD_BYTES
        headers.append((b"X-Padding", b"p" * draw(st.sampled_from([15 * 1024, MAX_REQUEST_HEAD_BYTES]))))
    headers = draw(st.permutations(headers))
    # Now and then, a body announced (or Content-Length: 0, which is allowed).
    framing = draw(st.sampled_from([None] * 12 + [b"Content-Length: 0", b"Content-Length: 4", b"Transfer-Encoding: chunked"]))
    lines = [method + b" " + target + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    if framing is not None:
        lines.insert(draw(st.integers(1, len(lines))), framing)
    # Now and then, a line (or every line) ending in a bare LF.
    ends = draw(st.sampled_from(["crlf"] * 12 + ["one bare lf", "all bare lf"]))
    bare = set(range(len(lines))) if ends == "all bare lf" else {draw(st.integers(0, len(lines) - 1))} if ends == "one bare lf" else set()
    return b"".join(line + (b"\n" if at in bare else b"\r\n") for at, line in enumerate(lines)) + b"\r\n"


VALID = (
    b"GET /v1/control HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: " + KEY + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _with(line: bytes, replaced: bytes | None = None) -> bytes:
    """VALID with one header line replaced (or, when `replaced` is None, a line added)."""
    if replaced is None:
        return VALID.replace(b"\r\n\r\n", b"\r\n" + line + b"\r\n\r\n")
    return VALID.replace(replaced, line)


@pytest.mark.fuzz
@fuzz_settings(500)
@given(raw=request_heads())
@example(raw=VALID)
@example(raw=_with(b"Host: xn--zz", b"Host: localhost"))  # not IDNA: wsproto raises UnicodeError
@example(raw=_with(b"Connection: Upgrade\xc3\xa9, Upgrade", b"Connection: Upgrade"))  # decoded as ASCII
@example(raw=_with(b"Sec-WebSocket-Protocol: caf\xc3\xa9"))
@example(raw=_with(b"Sec-WebSocket-Extensions: \xff"))
@example(raw=VALID.replace(b"HTTP/1.1", b"HTTP/1.0"))  # stricter: version
@example(raw=_with(b"Upgrade: websocket"))  # stricter: duplicate
@example(raw=_with(b"Sec-WebSocket-Key:", b"Sec-WebSocket-Key: " + KEY))  # stricter: empty key
@example(raw=_with(b"Connection: Upgrade\x1c", b"Connection: Upgrade"))  # stricter: str.strip()
@example(raw=_with(b"X-Padding: " + b"p" * MAX_REQUEST_HEAD_BYTES))  # stricter: size
@example(raw=_with(b"Content-Length: 4"))  # stricter: framing
@example(raw=_with(b"Content-Length: 0"))  # allowed: no body
@example(raw=VALID.replace(b"\r\n", b"\n"))  # stricter: framing
def test_our_handshake_check_agrees_with_wsproto(raw: bytes) -> None:
    event(agreement(raw))


# The documented strictness, each shown once: wsproto accepts, we refuse.
@pytest.mark.parametrize(
    "raw, reason",
    [
        (VALID.replace(b"HTTP/1.1", b"HTTP/1.0"), "http/1.0"),
        (_with(b"Connection: Upgrade"), "duplicate header"),
        (_with(b"Sec-WebSocket-Version: 13"), "duplicate header"),
        (_with(b"Sec-WebSocket-Key:", b"Sec-WebSocket-Key: " + KEY), "key not a nonce"),
        (_with(b"Sec-WebSocket-Key: \xc3\xa9", b"Sec-WebSocket-Key: " + KEY), "key not a nonce"),
        (_with(b"Connection: keep-alive, Upgrade\x1f", b"Connection: Upgrade"), "control byte around the upgrade token"),
        (_with(b"X-Padding: " + b"p" * MAX_REQUEST_HEAD_BYTES), HEAD_TOO_LARGE),
        (_with(b"Content-Length: 4"), "ambiguous framing"),
        (_with(b"Transfer-Encoding: chunked"), "ambiguous framing"),
        (VALID.replace(b"\r\n", b"\n"), "ambiguous framing"),
        (VALID.replace(b"Upgrade: websocket\r\n", b"Upgrade: websocket\n"), "ambiguous framing"),
    ],
)
def test_each_deliberate_strictness_is_real(raw: bytes, reason: str) -> None:
    head = our_head(raw)
    assert head is not None and wsproto_accepts(raw)
    assert isinstance(head, HeadTooLarge) or not is_valid_websocket_handshake(head)
    assert stricter_reasons(head) == [reason]


def _head(headers: list[tuple[bytes, bytes]], request_line: bytes = b"GET /v1/control HTTP/1.1") -> bytes:
    return b"\r\n".join([request_line] + [name + b": " + value for name, value in headers]) + b"\r\n\r\n"


def test_every_single_defect_agrees_with_wsproto() -> None:
    """Deterministic complement of the property: a valid request with exactly one header
    changed, removed or duplicated, every way the generator knows, each one checked."""
    valid = [(name, values[0]) for name, values in GOOD.items()]
    heads = [_head(valid)]
    for index, (name, good) in enumerate(valid):
        before, after = valid[:index], valid[index + 1 :]
        heads.append(_head(before + after))  # absent
        for value in odd_values(name):
            heads.append(_head(before + [(name, value)] + after))  # changed
            heads.append(_head(before + [(name, good), (name, value)] + after))  # duplicated,
            heads.append(_head(before + [(name, value), (name, good)] + after))  # either order
    heads += [_head(valid + [(b"content-length", b"4")]), _head(valid + [(b"content-length", b"0")])]
    heads.append(_head(valid).replace(b"\r\n", b"\n"))
    for line in [b"POST /v1/control HTTP/1.1", b"get /v1/control HTTP/1.1", b"GET /v1/control HTTP/1.0", b"GET /v1/control?x=1 HTTP/1.1"]:
        heads.append(_head(valid, line))
    outcomes = Counter(agreement(raw) for raw in heads)
    # Each kind of outcome is reached, so none of the branches above is vacuous.
    expected = {"both accept", "both refuse"} | {f"stricter: {reason}" for reason in STRICTER_THAN_WSPROTO}
    assert expected <= set(outcomes), outcomes
