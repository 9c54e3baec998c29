"""An upgrade request with a body or bare-LF line endings is refused 400 before the gate.

Bytes an upgrade sends as a body are replayed to the WebSocket library after the head and
read as the peer's first frames; bare LF line endings let an intermediary and the daemon see
different header lines. Both are refused before the gate runs, so nothing is recorded.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
import trio

from sandbox_supervisor.daemon.edge.http_front import (
    HeadReader,
    Route,
    RoutePaths,
    classify,
    has_bare_lf,
    is_valid_websocket_handshake,
    upgrade_framing_defect,
)

PATHS = RoutePaths(control="/v1/control", health="/healthz", metrics=None)
HANDSHAKE = [
    b"GET /v1/control HTTP/1.1",
    b"Host: localhost",
    b"Upgrade: websocket",
    b"Connection: Upgrade",
    b"Sec-WebSocket-Version: 13",
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
]


def _raw(lines: list[bytes], eol: bytes = b"\r\n") -> bytes:
    return eol.join(lines) + eol + eol


def _read(raw: bytes):
    reader = HeadReader()
    head = reader.feed(raw)
    assert head is not None
    return head


# (extra header lines, line ending, route). Content-Length: 0 announces no body: allowed.
FRAMING_TABLE = [
    ([], b"\r\n", Route.CONTROL_UPGRADE),
    ([b"Content-Length: 0"], b"\r\n", Route.CONTROL_UPGRADE),
    ([b"Content-Length: 5"], b"\r\n", Route.BAD_UPGRADE),
    ([b"Content-Length: 1"], b"\r\n", Route.BAD_UPGRADE),
    ([b"Content-Length: 00"], b"\r\n", Route.BAD_UPGRADE),  # only the plain 0 is allowed
    ([b"Transfer-Encoding: chunked"], b"\r\n", Route.BAD_UPGRADE),
    ([b"Transfer-Encoding: chunked", b"Content-Length: 0"], b"\r\n", Route.BAD_UPGRADE),
    ([], b"\n", Route.BAD_UPGRADE),
    ([b"Content-Length: 0"], b"\n", Route.BAD_UPGRADE),
]


@pytest.mark.parametrize("extra, eol, route", FRAMING_TABLE)
def test_upgrade_framing_table(extra, eol, route):
    head = _read(_raw(HANDSHAKE + extra, eol))
    assert classify(head, PATHS) is route
    assert is_valid_websocket_handshake(head) is (route is Route.CONTROL_UPGRADE)
    assert (upgrade_framing_defect(head) is None) is (route is Route.CONTROL_UPGRADE)


def test_one_bare_lf_line_is_enough():
    raw = _raw(HANDSHAKE).replace(b"Upgrade: websocket\r\n", b"Upgrade: websocket\n")
    head = _read(raw)
    assert head.bare_lf and classify(head, PATHS) is Route.BAD_UPGRADE


@pytest.mark.parametrize(
    "head_bytes, bare",
    [(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False), (b"GET / HTTP/1.1\nHost: x\r\n\r\n", True), (b"GET / HTTP/1.1\r\n\n", True)],
)
def test_bare_lf_is_read_on_the_raw_bytes(head_bytes, bare):
    assert has_bare_lf(head_bytes) is bare


def test_a_request_that_is_no_upgrade_keeps_its_route():
    # Only upgrades of the control path are refused for their framing: a plain GET with a
    # body still gets 426, health still answers.
    plain = _read(_raw([b"GET /v1/control HTTP/1.1", b"Host: x", b"Content-Length: 3"]))
    assert classify(plain, PATHS) is Route.UPGRADE_REQUIRED
    health = _read(_raw([b"GET /healthz HTTP/1.1", b"Host: x"], b"\n"))
    assert classify(health, PATHS) is Route.HEALTH


# --- over the wire: TCP and unix --------------------------------------------------------


def _endpoint(daemon, transport):
    return daemon.tcp if transport == "tcp" else daemon.unix


def _jti(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]


async def _send_and_read(endpoint, raw: bytes) -> bytes:
    stream = await endpoint.open_stream()
    await stream.send_all(raw)
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(4096):
            data += chunk
    await stream.aclose()
    return data


@pytest.mark.parametrize(
    "extra, eol, body",
    [
        ([b"Content-Length: 14"], b"\r\n", b"\x81\x08smuggled"),
        ([b"Transfer-Encoding: chunked"], b"\r\n", b"4\r\nabcd\r\n0\r\n\r\n"),
        ([], b"\n", b""),
    ],
    ids=["content-length", "transfer-encoding", "bare-lf"],
)
async def test_an_upgrade_with_a_body_or_bare_lf_is_400_and_records_nothing(daemon, transport, extra, eol, body):
    client = daemon.client()
    token = client.mint(generation=1, attempt_id="a-1", ack_floor=0)
    routing = client.routing_headers(generation=1, attempt_id="a-1", ack_floor=0, assertion=token)
    lines = HANDSHAKE + [name.encode() + b": " + value.encode() for name, value in routing] + extra
    answer = await _send_and_read(_endpoint(daemon, transport), _raw(lines, eol) + body)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 400 Bad Request"
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"] == "bad_request"
    store = daemon.supervisor.store
    assert store.snapshot().fence_generation == 0
    assert not store.upgrade_state(_jti(token), time.time()).jti_seen
    # The same head, well framed, is admitted: the refusal was the framing's, nothing else.
    async with client.connect(generation=1):
        pass
    assert store.snapshot().fence_generation == 1


async def test_content_length_zero_upgrade_is_admitted(daemon, transport):
    client = daemon.client()
    token = client.mint(generation=1, attempt_id="a-1", ack_floor=0)
    routing = client.routing_headers(generation=1, attempt_id="a-1", ack_floor=0, assertion=token)
    lines = HANDSHAKE + [name.encode() + b": " + value.encode() for name, value in routing] + [b"Content-Length: 0"]
    stream = await _endpoint(daemon, transport).open_stream()
    await stream.send_all(_raw(lines))
    data = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
    await trio.aclose_forcefully(stream)
    assert data.startswith(b"HTTP/1.1 101 ")
    assert daemon.supervisor.store.snapshot().fence_generation == 1
