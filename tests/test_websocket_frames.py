"""The inbound frame loop of the daemon's WebSocket (`websocket.ServerWebSocket`): plain
frames decoded by the daemon itself and everything else through wsproto give the messages a
client sent, whatever the frames, fragments, interleaved pings and read boundaries; and a
malformed frame is refused with the close code wsproto gives it.

The stream here is scripted (each read returns the next chunk), so the read boundaries are
chosen by the test: what the frame loop decides is pure logic over the bytes it is given.
The same socket over real TCP and unix sockets is tests/test_websocket.py."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.frame_protocol import FrameProtocol, Opcode

from sandbox_supervisor.daemon.websocket import (
    CLOSE_MESSAGE_TOO_BIG,
    READ_AHEAD_MESSAGES,
    ConnectionClosed,
    ServerWebSocket,
    StreamIO,
)

MAX_MESSAGE = 70_000  # above 65,535, so plain frames with 64-bit lengths occur too
PROTOCOL_ERROR = 1002
INVALID_PAYLOAD = 1007


class ScriptedIO(StreamIO):
    """Reads return the given chunks in order, then the end of the stream; writes are kept."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)
        self.written = bytearray()
        self.closed = False

    _socket = None  # not a socket: StreamIO's own writes go through send_all

    async def send_all(self, data: bytes | bytearray | memoryview, before_wait=None) -> None:
        self.written += data

    async def receive_some(self, max_bytes: int = 0) -> bytes:
        await trio.lowlevel.checkpoint()
        return self._chunks.pop(0) if self._chunks else b""

    async def aclose(self) -> None:
        self.closed = True


def client_frames(messages: list[tuple[str | bytes, int, bool]]) -> tuple[bytes, list[bytes]]:
    """Masked client frames for each (message, fragments, ping in between): a message in
    `fragments` frames (continuations after the first), with a ping between its first two
    frames when asked. Returns the bytes and the ping payloads in order."""
    framer = FrameProtocol(client=True, extensions=[])
    out = bytearray()
    pings: list[bytes] = []
    for message, fragments, ping in messages:
        data = message.encode("utf-8") if isinstance(message, str) else message
        opcode = Opcode.TEXT if isinstance(message, str) else Opcode.BINARY
        cuts = sorted({len(data) * i // fragments for i in range(1, fragments)})
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        for index, piece in enumerate(pieces):
            out += framer._serialize_frame(opcode if index == 0 else Opcode.CONTINUATION, piece, fin=index == len(pieces) - 1)
            if ping and index == 0:
                payload = os.urandom(4)
                pings.append(payload)
                out += framer.ping(payload)
    return bytes(out), pings


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


async def receive_all(ws: ServerWebSocket) -> tuple[list[str | bytes], ConnectionClosed]:
    received: list[str | bytes] = []
    while True:
        try:
            received.append(await ws.get_message())
        except ConnectionClosed as closed:
            return received, closed


def pongs_in(written: bytes) -> list[bytes]:
    server_side = FrameProtocol(client=True, extensions=[])  # reads the server's unmasked frames
    server_side.receive_bytes(written)
    return [bytes(frame.payload) for frame in server_side.received_frames() if frame.opcode is Opcode.PONG]


texts = st.text(max_size=300) | st.sampled_from(["", "é ✓ 😀" * 20, "x" * 125, "x" * 126, "y" * 65_535, "z" * 65_536])
binaries = st.binary(max_size=300) | st.sampled_from([b"", b"\x00" * 125, b"\x01" * 126, b"\x02" * 65_536])
one_message = st.tuples(texts | binaries, st.integers(min_value=1, max_value=3), st.booleans())


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(one_message, max_size=6), cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12))
def test_every_message_arrives_whatever_the_frames_and_the_reads(messages, cuts):
    data, pings = client_frames(messages)
    io = ScriptedIO(chunked(data, cuts))
    ws = ServerWebSocket(io, max_message_size=MAX_MESSAGE)
    received, closed = trio.run(receive_all, ws)
    assert received == [message for message, _, _ in messages]
    assert closed.reason is not None and closed.reason.code == 1006  # the script ended, no close frame
    assert pongs_in(bytes(io.written)) == pings  # every ping answered, in order


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=6))
def test_frames_pipelined_with_the_head_come_first(cuts):
    first, _ = client_frames([("pipelined", 1, False), (b"\x00binary", 2, False)])
    rest, _ = client_frames([("from the stream", 1, True)])
    io = ScriptedIO(chunked(rest, cuts))
    ws = ServerWebSocket(io, max_message_size=MAX_MESSAGE, received=first)
    received, _ = trio.run(receive_all, ws)
    assert received == ["pipelined", b"\x00binary", "from the stream"]


def _refused(data: bytes) -> ConnectionClosed:
    io = ScriptedIO([data])
    ws = ServerWebSocket(io, max_message_size=MAX_MESSAGE)
    received, closed = trio.run(receive_all, ws)
    assert received == []
    # The peer is told why (RFC 6455, section 7.1.7), then the stream closes.
    peer = FrameProtocol(client=True, extensions=[])
    peer.receive_bytes(bytes(io.written))
    (frame,) = list(peer.received_frames())
    assert frame.opcode is Opcode.CLOSE and closed.reason is not None and frame.payload[0] == closed.reason.code
    assert io.closed
    return closed


def _masked(first: int, payload: bytes, length_bytes: bytes | None = None) -> bytes:
    mask = b"\x11\x22\x33\x44"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    if length_bytes is None:
        length_bytes = bytes((0x80 | len(payload),))
    return bytes((first,)) + length_bytes + mask + masked


@pytest.mark.parametrize(
    "frame, code",
    [
        (_masked(0x81, b"\xff\xfe not utf-8"), INVALID_PAYLOAD),  # a plain text frame that is not UTF-8
        (_masked(0x81, b"abc", bytes((0x80 | 126,)) + (3).to_bytes(2, "big")), PROTOCOL_ERROR),  # a longer length than needed
        (_masked(0xC1, b"abc"), PROTOCOL_ERROR),  # RSV1 set: no extension was negotiated
        (bytes((0x81, 3)) + b"abc", PROTOCOL_ERROR),  # not masked
        (_masked(0x80, b"abc"), PROTOCOL_ERROR),  # a continuation with no message to continue
        (_masked(0x83, b"abc"), PROTOCOL_ERROR),  # a reserved opcode
        # A new message while a fragmented one is unfinished (its continuation was owed).
        (_masked(0x01, b"ab") + _masked(0x81, b"cd"), PROTOCOL_ERROR),
    ],
)
def test_a_malformed_frame_is_refused_with_wsprotos_code(frame, code):
    closed = _refused(frame)
    assert closed.reason is not None and closed.reason.code == code


def test_a_frame_over_the_limit_is_1009_however_it_arrives():
    framer = FrameProtocol(client=True, extensions=[])
    for message in ("t" * (MAX_MESSAGE + 1), b"b" * (MAX_MESSAGE + 1)):
        data = bytes(framer.send_data(message, True))
        for chunks in ([data], chunked(data, [3, 1000, 40_000])):
            io = ScriptedIO(chunks)
            ws = ServerWebSocket(io, max_message_size=MAX_MESSAGE)
            received, closed = trio.run(receive_all, ws)
            assert received == []
            assert closed.reason is not None and closed.reason.code == CLOSE_MESSAGE_TOO_BIG
            assert io.written[:2] == b"\x88" + bytes((len(io.written) - 2,))  # the close frame, sent


VALID_AFTER = FrameProtocol(client=True, extensions=[]).send_data("carried out?", True)


@pytest.mark.parametrize(
    "refused",
    [
        _masked(0x81, b"\xff\xfe not utf-8"),
        bytes((0x81, 3)) + b"abc",  # not masked
        _masked(0xC1, b"abc"),  # RSV1
        _masked(0x80, b"abc"),  # a continuation with nothing to continue
        _masked(0x88, (999).to_bytes(2, "big")),  # a close code nobody may send
        _masked(0x88, (1000).to_bytes(2, "big") + b"\xff"),  # a close reason that is not UTF-8
        _masked(0x09, b"p"),  # a fragmented ping
    ],
)
def test_nothing_after_a_refused_frame_is_taken(refused):
    """RFC 6455, section 7.1.7: once the connection is failed, no more data is processed. A
    valid frame in the same read as a refused one (a tool call behind it) is not a message."""
    ws = ServerWebSocket(ScriptedIO([refused + bytes(VALID_AFTER)]), max_message_size=MAX_MESSAGE)
    received, closed = trio.run(receive_all, ws)
    assert received == []
    assert closed.reason is not None and closed.reason.code in (PROTOCOL_ERROR, INVALID_PAYLOAD)


def test_nothing_after_the_peers_close_is_taken():
    framer = FrameProtocol(client=True, extensions=[])
    data = bytes(framer.send_data("before", True)) + bytes(framer.close(4400, "bye")) + bytes(VALID_AFTER)
    io = ScriptedIO([data])
    received, closed = trio.run(receive_all, ServerWebSocket(io, max_message_size=MAX_MESSAGE))
    assert received == ["before"]
    assert closed.reason is not None and (closed.reason.code, closed.reason.reason) == (4400, "bye")
    assert io.written[:1] == b"\x88" and io.closed  # answered, then the stream closed


def test_endless_empty_fragments_reach_the_limit():
    """Empty continuation frames count toward the message limit (one each): a peer cannot grow
    the daemon's list of parts for ever without reaching 1009."""
    framer = FrameProtocol(client=True, extensions=[])
    start = bytes(framer._serialize_frame(Opcode.TEXT, b"", fin=False))
    empty = bytes(framer._serialize_frame(Opcode.CONTINUATION, b"", fin=False))
    limit = 1000
    ws = ServerWebSocket(ScriptedIO([start + empty * (limit + 5)]), max_message_size=limit)
    received, closed = trio.run(receive_all, ws)
    assert received == []
    assert closed.reason is not None and closed.reason.code == CLOSE_MESSAGE_TOO_BIG
    assert len(ws._parts) == 0


def test_a_ping_reads_ahead_at_most_its_bound_even_from_one_read():
    """Many small messages in one read: the keepalive's ping queues READ_AHEAD_MESSAGES of
    them and leaves the rest in the buffer for the socket's own task, in order."""
    framer = FrameProtocol(client=True, extensions=[])
    chunk = b"".join(bytes(framer.send_data(f"m{n}", True)) for n in range(50))
    ws = ServerWebSocket(ScriptedIO([chunk]), max_message_size=MAX_MESSAGE)

    async def main() -> list[str | bytes]:
        with trio.move_on_after(0.2):  # its pong never comes: only the bound is looked at
            await ws.ping()
        assert len(ws._messages) == READ_AHEAD_MESSAGES
        return [await ws.get_message() for _ in range(50)]

    assert trio.run(main) == [f"m{n}" for n in range(50)]


def test_no_control_frame_follows_our_close_frame():
    """A ping that waited for the write lock behind our close is not written after it."""
    io = ScriptedIO([])
    ws = ServerWebSocket(io, max_message_size=MAX_MESSAGE)
    outcome: list[str] = []

    async def ping() -> None:
        try:
            await ws.ping()
        except ConnectionClosed:
            outcome.append("refused")

    async def main() -> None:
        await ws._write_lock.acquire()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.aclose, 4001, "superseded")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ping)
            await trio.testing.wait_all_tasks_blocked()
            ws._write_lock.release()

    trio.run(main)
    assert outcome == ["refused"]
    frames = FrameProtocol(client=True, extensions=[])
    frames.receive_bytes(bytes(io.written))
    assert [frame.opcode for frame in frames.received_frames()] == [Opcode.CLOSE]
