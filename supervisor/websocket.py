"""A control socket's WebSocket, server side: wsproto's sans-IO `Connection` over the
accepted stream, read and written by the daemon's own tasks.

The front (`server.handle_stream`) has already read and checked the upgrade's head with h11
(`http_front`); it answers the upgrade with `accept_response` and wraps the stream here.
Inbound bytes go to wsproto, which parses frames, checks them and keeps the close state;
outbound messages are framed here (a server's frames are unmasked, and no extension is ever
negotiated), and only control frames (close, ping, pong) go through wsproto.

Why not trio-websocket's server (the clients and the tests still use its client): it parses
the request head a second time, runs a reader task per connection that hands every message
to the application through a memory channel (a task switch per inbound message), and sends
one message per write. Here the task that wants a message reads it: `get_message` reads the
socket, feeds wsproto and answers control frames on the way. Behaviour is trio-websocket's
where the daemon relied on it (docs/internals.md, "The control socket's WebSocket"): pings
answered, a message over the limit closed with 1009, a peer's close answered and the stream
closed, a lost stream seen as 1006, `closed` and `ConnectionClosed` carrying the close.

One reader at a time: the socket's own task reads in `get_message`; `ping` (the keepalive)
reads only while no one else does, so a pong is seen even while the socket's task is busy
elsewhere, and it reads ahead at most `READ_AHEAD_MESSAGES` messages for that task.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, Pong, TextMessage
from wsproto.utilities import generate_accept_token

from sandbox_supervisor.daemon import fd_wait

# What one read of a control socket asks for (trio's SocketStream default; trio-websocket's
# 4 KiB made large messages about 3x slower).
RECEIVE_BUFFER_BYTES = 64 * 1024
# Messages a ping may read ahead while the socket's own task is busy elsewhere (waiting for a
# call slot, say): enough to reach a pong behind a few frames, bounded so that a peer that
# keeps sending cannot make the daemon hold more.
READ_AHEAD_MESSAGES = 8
# Frames that are ready together share a socket write up to this many bytes (a larger frame
# is a write of its own): few system calls for a burst, while a write timeout still measures
# a peer's progress in steps this small.
WRITE_BATCH_MAX_BYTES = 256 * 1024
# A message at least this long is written as its header then its own bytes (two writes under
# one lock), never copied into a batch: a binary exec.output_page is up to 1 MiB.
LARGE_MESSAGE_BYTES = 64 * 1024
# RFC 6455 §7.4.1.
CLOSE_NORMAL = 1000
CLOSE_ABNORMAL = 1006  # never sent: the stream ended without a close handshake
CLOSE_MESSAGE_TOO_BIG = 1009

# RFC 6455, section 5.2: FIN with the opcode, no RSV bits (no extension is negotiated).
_FIN_TEXT = 0x81
_FIN_BINARY = 0x82
_FIN_BIT = 0x80
_OPCODE_BITS = 0x0F
_OP_CONTINUATION = 0x0
_OP_TEXT = 0x1
_OP_BINARY = 0x2
_MASK_BIT = 0x80
_LENGTH_BITS = 0x7F
_MASK_BYTES = 4
_LENGTH_7_MAX = 125
_LENGTH_16 = 126
_LENGTH_64 = 127
_LENGTH_16_MAX = 0xFFFF
_LENGTH_64_MAX = (1 << 63) - 1


def accept_response(key: bytes) -> bytes:
    """The 101 that completes an upgrade whose `Sec-WebSocket-Key` is `key` (as h11 parsed
    it), byte for byte what wsproto's handshake writes when it accepts with no subprotocol,
    no extension and no extra header."""
    return (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + generate_accept_token(key) + b"\r\n\r\n"
    )


def frame_header(opcode_byte: int, length: int) -> bytes:
    """The header of a final, unmasked frame (a server's) of `length` payload bytes, with the
    shortest length encoding, as wsproto writes it."""
    if length <= _LENGTH_7_MAX:
        return bytes((opcode_byte, length))
    if length <= _LENGTH_16_MAX:
        return bytes((opcode_byte, _LENGTH_16)) + length.to_bytes(2, "big")
    return bytes((opcode_byte, _LENGTH_64)) + length.to_bytes(8, "big")


# A message to send: text (str), binary (bytes), or a binary message given as two parts
# written one after the other without being joined (a binary exec.output_page: its header,
# then up to 1 MiB of spooled bytes).
Outgoing = str | bytes | tuple[bytes, bytes]


def outgoing_size(message: Outgoing) -> int:
    """What a message counts against a queue's bound: characters of text, bytes of binary."""
    if isinstance(message, tuple):
        return len(message[0]) + len(message[1])
    return len(message)


def frame_message(message: Outgoing) -> tuple[bytes, bytes, bytes]:
    """A whole message as one frame: (header, payload, more payload). Text is UTF-8, binary
    as it is; the third part is the second of a message given in two, else empty."""
    if isinstance(message, str):
        payload = message.encode("utf-8")
        return frame_header(_FIN_TEXT, len(payload)), payload, b""
    if isinstance(message, tuple):
        head, tail = message
        return frame_header(_FIN_BINARY, len(head) + len(tail)), head, tail
    return frame_header(_FIN_BINARY, len(message)), message, b""


def _frame_extent(buffer: bytearray, start: int) -> tuple[int, int] | None:
    """(header length, with the mask; payload length) of the frame at `start`, or None while
    its header is incomplete. Nothing is checked here but the extent."""
    available = len(buffer) - start
    if available < 2:
        return None
    second = buffer[start + 1]
    length = second & _LENGTH_BITS
    header = 2
    if length == _LENGTH_16:
        header = 4
    elif length == _LENGTH_64:
        header = 10
    if available < header:
        return None
    if header > 2:
        length = int.from_bytes(buffer[start + 2 : start + header], "big")
    return header + (_MASK_BYTES if second & _MASK_BIT else 0), length


def _shortest_length(short: int, length: int) -> bool:
    """The length is in the shortest encoding, as RFC 6455 requires and wsproto checks."""
    if short == _LENGTH_16:
        return length > _LENGTH_7_MAX
    if short == _LENGTH_64:
        return _LENGTH_16_MAX < length <= _LENGTH_64_MAX
    return True


def _decode_plain(buffer: bytearray, start: int, header_len: int, end: int) -> str | bytes | None:
    """The message of a whole plain frame (see `ServerWebSocket._is_plain`): unmasked, and
    for text decoded from UTF-8; None when the text is not UTF-8."""
    payload_start = start + header_len
    length = end - payload_start
    mask = bytes(buffer[payload_start - _MASK_BYTES : payload_start])
    if length:
        # XOR with the mask repeated over the payload, as one integer operation.
        key = int.from_bytes((mask * (length // _MASK_BYTES + 1))[:length], "little")
        payload = (int.from_bytes(buffer[payload_start:end], "little") ^ key).to_bytes(length, "little")
    else:
        payload = b""
    if buffer[start] == _FIN_BINARY:
        return payload
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _may_send(state: ConnectionState, event: Event) -> bool:
    """Whether a control frame may still go out: a close while open or answering the peer's;
    a ping or pong only while open (never after a close frame)."""
    if isinstance(event, CloseConnection):
        return state is ConnectionState.OPEN or state is ConnectionState.REMOTE_CLOSING
    return state is ConnectionState.OPEN


@dataclass(frozen=True, slots=True)
class CloseReason:
    """How a WebSocket closed: the code and reason of the close frame, or 1006 and None when
    the stream ended without one."""

    code: int
    reason: str | None


class ConnectionClosed(Exception):
    """The WebSocket is closed (or closing): nothing more can be sent, and no more messages
    will come. `reason` says how it closed."""

    def __init__(self, reason: CloseReason | None) -> None:
        super().__init__(reason)
        self.reason = reason


class StreamIO:
    """The bytes of an accepted stream. A socket is read and written directly: trio's
    `SocketStream.send_all` yields to the scheduler after a write the socket took whole (a
    pass of the event loop per frame written), and its `receive_some` reads before it waits,
    failing with EAGAIN before nearly every message (a control socket's peer mostly waits for
    an answer before it sends again). Any other stream goes through its own methods. Errors
    are trio's: a closed stream ClosedResourceError, any other failure BrokenResourceError."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None

    async def send_all(self, data: bytes | bytearray | memoryview, before_wait: Callable[[], None] | None = None) -> None:
        """All of `data`, waiting only while the socket is full (`wait_writable` is then the
        checkpoint, where a write deadline cancels, leaving a partial frame behind);
        `before_wait` is called once, before the first wait (or before any write, on a stream
        that is not a socket): a write deadline costs nothing when the socket takes the write
        at once. Callers hold the WebSocket's write lock, so no two writes interleave."""
        sock = self._socket
        if sock is None:
            if before_wait is not None:
                before_wait()
            await self.stream.send_all(data)
            return
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                try:
                    sent += os.write(sock.fileno(), view[sent:])
                except BlockingIOError:
                    if before_wait is not None:
                        before_wait()
                        before_wait = None
                    await fd_wait.wait_writable(sock)  # closed: ClosedResourceError
                except OSError as exc:
                    if exc.errno == errno.EBADF:  # fileno() is -1 once the socket is closed
                        raise trio.ClosedResourceError("the socket was already closed") from None
                    raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    @property
    def socket_backed(self) -> bool:
        """A socket written directly (`write_now` and `wait_writable` work)."""
        return self._socket is not None

    def write_now(self, data: bytes) -> int | None:
        """As much of `data` as the socket takes without waiting: the count of bytes written
        (0 when it is full). None when nothing was written and this stream cannot be written
        without a task (not a socket), or the write failed: the next awaited write meets the
        failure and reports it as `send_all` does."""
        sock = self._socket
        if sock is None:
            return None
        try:
            return os.write(sock.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError:
            return None

    async def wait_writable(self) -> None:
        """Until the socket has room (only a socket stream: `write_now` gave a count)."""
        assert self._socket is not None
        await fd_wait.wait_writable(self._socket)  # closed: ClosedResourceError

    async def receive_some(self, max_bytes: int = RECEIVE_BUFFER_BYTES) -> bytes | bytearray:
        """Up to `max_bytes`, waiting for the socket to be readable first; b"" at the end."""
        sock = self._socket
        if sock is None:
            return await self.stream.receive_some(max_bytes)
        while True:
            await fd_wait.wait_readable(sock)  # closed: ClosedResourceError
            try:
                return os.read(sock.fileno(), max_bytes)
            except BlockingIOError:
                continue  # readable was reported, and another reader took it: wait again
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    raise trio.ClosedResourceError("the socket was already closed") from None
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    async def aclose(self) -> None:
        await self.stream.aclose()


class ServerWebSocket:
    """An accepted (101 sent) server WebSocket over `io`. `received`: bytes that came after
    the request head (a pipelining client's first frames), read before the stream."""

    def __init__(self, io: StreamIO, *, max_message_size: int, received: bytes = b"") -> None:
        self._io = io
        self._wsproto = Connection(ConnectionType.SERVER)
        self._max_message_size = max_message_size
        # Inbound bytes not yet taken as frames; what came after the head comes first.
        self._buffer = bytearray(received)
        self._unparsed = bool(received)  # the buffer may hold whole frames not yet taken
        self._owed = 0  # bytes of the frame wsproto is reading that it has not been given yet
        self._fragmented = False  # wsproto holds a fragmented message's first frames
        # Set once the socket is closing or closed (by either side, or by a lost stream):
        # nothing is sent after it, and `get_message` raises once the queue is empty.
        self._close_reason: CloseReason | None = None
        # Set once no message will be taken any more (a local close, a message over the
        # limit): what is queued is dropped, and `get_message` raises at once.
        self._discarding = False
        self._messages: deque[str | bytes] = deque()
        self._parts: list[str | bytes] = []
        self._part_size = 0
        self._write_lock = trio.StrictFIFOLock()
        # The rest of a write `write_now` began and the socket did not take whole: the next
        # write under the lock writes it first, so frames stay whole and in order.
        self._carry = b""
        self._reading = False  # a task is in _read
        # wsproto holds events not yet handled here (a read's handling was cancelled).
        self._unhandled = False
        self._read_done = trio.Event()  # set (and replaced) when a read and its events are done
        self._pings: OrderedDict[bytes, trio.Event] = OrderedDict()
        self._close_handshake = trio.Event()  # both close frames seen, or the stream lost
        # Our close (1009) stays what `closed` says when the peer answers it.
        self._reason_is_final = False
        self._stream_closed = False

    @property
    def closed(self) -> CloseReason | None:
        """How the socket closed (or is closing); None while it is open."""
        return self._close_reason

    # --- receiving ---------------------------------------------------------------------

    async def get_message(self) -> str | bytes:
        """The next message (str for text, bytes for binary). Messages that arrived before the
        peer's close are still returned; after that, and after a local close, ConnectionClosed."""
        while True:
            if self._messages and not self._discarding:
                return self._messages.popleft()
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            await self._read()

    async def _read(self, queue_bound: int | None = None) -> None:
        """One read of the stream and the frames it completes; when another task is reading,
        wait for its read instead (its frames may be what the caller waits for). With
        `queue_bound`, frames are taken only while fewer messages than that are queued: the
        rest stays in the buffer for the next read."""
        if self._reading:
            await self._read_done.wait()
            return
        self._reading = True
        try:
            if self._unhandled or self._unparsed:
                # What is already here (the first frames, pipelined with the head; what a
                # cancelled or bounded read left) comes before the stream is read again.
                if self._unhandled:
                    await self._handle_events()
                if self._unparsed:
                    await self._take_frames(queue_bound)
                return
            try:
                data = await self._io.receive_some(RECEIVE_BUFFER_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                # The stream ended (or broke) before the close handshake finished.
                self._abort()
                return
            self._buffer += data
            await self._take_frames(queue_bound)
        finally:
            self._reading = False
            done, self._read_done = self._read_done, trio.Event()
            done.set()

    async def _take_frames(self, queue_bound: int | None = None) -> None:
        """Every whole frame in the buffer. A final text or binary frame that fits the
        message limit, with no fragmented message in progress, is decoded here (its UTF-8
        checked as wsproto checks it); every other frame (control frames, fragments, a frame
        over the limit, anything malformed) goes to wsproto, as it arrives. wsproto is only
        ever given whole frames, or the rest of the one it is reading, so it never holds a
        frame this loop would have to know about. Once a close has been seen (the peer's, or a
        frame wsproto refused) nothing after it is taken (RFC 6455, section 7.1.7: no more
        data after the connection is failed)."""
        self._unparsed = True
        buffer = self._buffer
        start = 0
        try:
            while start < len(buffer):
                if self._close_handshake.is_set():
                    start = len(buffer)  # dropped: the stream is closed
                    break
                if queue_bound is not None and len(self._messages) >= queue_bound:
                    return  # the rest waits, unparsed, for the next read
                if self._owed:  # the rest of the frame wsproto is reading
                    piece = min(self._owed, len(buffer) - start)
                    chunk = bytes(buffer[start : start + piece])
                    start += piece
                    self._owed -= piece
                    await self._feed(chunk)
                    continue
                extent = _frame_extent(buffer, start)
                if extent is None:
                    break  # the header is not all here yet
                header_len, length = extent
                end = start + header_len + length
                if self._is_plain(buffer[start], buffer[start + 1], length):
                    if end > len(buffer):
                        break  # at most the message limit (and a header) is held, whole
                    message = _decode_plain(buffer, start, header_len, end)
                    if message is not None:
                        start = end
                        if not self._discarding:
                            self._messages.append(message)
                        continue
                    # Not UTF-8: wsproto refuses it with the close code it owes (1007).
                opcode, fin = buffer[start] & _OPCODE_BITS, buffer[start] & _FIN_BIT
                if opcode in (_OP_TEXT, _OP_BINARY) and not fin:
                    self._fragmented = True
                elif opcode == _OP_CONTINUATION and fin:
                    self._fragmented = False
                self._owed = header_len + length
            self._unparsed = False
        finally:
            del buffer[:start]

    def _is_plain(self, first: int, second: int, length: int) -> bool:
        """A frame decoded here: final, no RSV bits, text or binary, masked (a client's),
        within the message limit, its length in the shortest encoding, on an open
        connection, with no fragmented message in progress."""
        return (
            (first == _FIN_TEXT or first == _FIN_BINARY)
            and second & _MASK_BIT != 0
            and length <= self._max_message_size
            and not self._fragmented
            and _shortest_length(second & _LENGTH_BITS, length)
            and self._wsproto.state is ConnectionState.OPEN
            and self._close_reason is None
        )

    async def _feed(self, chunk: bytes) -> None:
        """Bytes of a frame for wsproto, and the events they complete."""
        if self._wsproto.state is ConnectionState.CLOSED:
            return  # after the close handshake nothing more is read
        self._wsproto.receive_data(chunk)
        await self._handle_events()

    async def _handle_events(self) -> None:
        self._unhandled = True
        for event in self._wsproto.events():
            await self._on_event(event)
            if self._close_handshake.is_set():
                break  # nothing after the close (a refused frame's, or the peer's) counts
        self._unhandled = False

    async def _on_event(self, event: Event) -> None:
        if isinstance(event, (TextMessage, BytesMessage)):
            await self._on_message(event)
        elif isinstance(event, Ping):
            # Answered while open; once a close is under way wsproto sends no pong (and
            # would refuse to frame one).
            if self._wsproto.state is ConnectionState.OPEN:
                await self._send_control(event.response())
        elif isinstance(event, Pong):
            self._on_pong(bytes(event.payload))
        elif isinstance(event, CloseConnection):
            await self._on_close(event)

    async def _on_message(self, event: TextMessage | BytesMessage) -> None:
        if self._discarding:
            return
        # Measured as trio-websocket measures it, in len() of the parts (characters of text):
        # the session layer checks the byte limit of a text message itself.
        data = event.data if isinstance(event.data, str) else bytes(event.data)
        # An empty fragment counts as one: a peer sending endless empty continuations would
        # otherwise grow the list of parts without ever reaching the limit.
        self._part_size += max(len(data), 1)
        if data:
            self._parts.append(data)
        if self._part_size > self._max_message_size:
            reason = f"Exceeded maximum message size: {self._max_message_size} bytes"
            self._parts, self._part_size = [], 0
            self._discarding = True
            self._messages.clear()
            self._close_reason = CloseReason(CLOSE_MESSAGE_TOO_BIG, reason)
            self._reason_is_final = True  # the peer's answer does not make it another close
            await self._send_control(CloseConnection(code=CLOSE_MESSAGE_TOO_BIG, reason=reason))
        elif event.message_finished:
            parts, self._parts, self._part_size = self._parts, [], 0
            if not parts:
                self._messages.append("" if isinstance(event, TextMessage) else b"")
            elif len(parts) == 1:
                self._messages.append(parts[0])
            elif isinstance(event, BytesMessage):
                self._messages.append(b"".join(part for part in parts if isinstance(part, bytes)))
            else:
                self._messages.append("".join(part for part in parts if isinstance(part, str)))

    def _on_pong(self, payload: bytes) -> None:
        """Wake the ping it answers and every earlier one (a peer may answer several pings
        with one pong)."""
        if payload not in self._pings:
            return
        while self._pings:
            key, waiter = self._pings.popitem(last=False)
            waiter.set()
            if key == payload:
                break

    async def _on_close(self, event: CloseConnection) -> None:
        """The peer's close, answered; or, in the state OPEN, a frame wsproto refused (its code
        is 1002 or 1007), told to the peer in a close frame of that code. Either way a server
        then closes the stream at once (RFC 6455, section 7.1.1)."""
        reason = CloseReason(event.code, event.reason or None)
        if self._reason_is_final:
            reason = self._close_reason or reason
        self._close_reason = reason
        try:
            if self._wsproto.state is ConnectionState.REMOTE_CLOSING:
                await self._send_control(event.response())
            elif self._wsproto.state is ConnectionState.OPEN:
                # A frame wsproto refused: the connection is failed, and the peer is told why
                # with a close frame of that code before the stream closes (RFC 6455,
                # section 7.1.7), without waiting for its answer.
                await self._send_control(CloseConnection(code=event.code, reason=event.reason))
        except ConnectionClosed:
            pass
        self._close_handshake.set()
        await self._close_stream()

    def _abort(self) -> None:
        """The stream ended or broke without a close handshake: closed as 1006."""
        if self._wsproto.state is ConnectionState.OPEN:
            # Moves wsproto out of OPEN, so that nothing more is framed for this stream.
            self._wsproto.send(CloseConnection(code=CLOSE_ABNORMAL))
        if self._close_reason is None:
            self._close_reason = CloseReason(CLOSE_ABNORMAL, None)
        self._close_handshake.set()

    # --- sending -----------------------------------------------------------------------

    async def send_message(self, message: Outgoing) -> None:
        await self.send_messages((message,))

    async def send_messages(
        self,
        messages: Sequence[Outgoing],
        *,
        deadline_scope: trio.CancelScope | None = None,
        write_timeout_s: float = 0.0,
    ) -> None:
        """`messages` as consecutive messages (text for str, binary for bytes), joined into
        writes of up to WRITE_BATCH_MAX_BYTES; a message of LARGE_MESSAGE_BYTES or more is
        written as its header then its own bytes. With `deadline_scope`, each write gets
        `write_timeout_s` from its start: the timeout measures the peer's progress, not the
        size of the burst. ConnectionClosed once the socket is closing: nothing is written
        after a close frame, including the rest of a batch a close overtook."""
        pending: list[bytes] = []
        size = 0
        for message in messages:
            header, payload, tail = frame_message(message)
            if len(payload) + len(tail) >= LARGE_MESSAGE_BYTES:
                if pending:
                    await self._write(b"".join(pending), deadline_scope, write_timeout_s)
                    pending, size = [], 0
                if tail:  # a page: its frame header and page header together, then its bytes
                    header, payload, tail = header + payload, tail, b""
                await self._write(header, deadline_scope, write_timeout_s, more=payload)
                continue
            pending.append(header)
            pending.append(payload)
            pending.append(tail)
            size += len(header) + len(payload) + len(tail)
            if size >= WRITE_BATCH_MAX_BYTES:
                await self._write(b"".join(pending), deadline_scope, write_timeout_s)
                pending, size = [], 0
        if pending:
            await self._write(b"".join(pending), deadline_scope, write_timeout_s)

    @property
    def carrying(self) -> bool:
        """Part of a frame `write_now` began is still to be written (`flush_carry`)."""
        return bool(self._carry)

    def write_now(self, messages: Sequence[str]) -> bool:
        """Write small text messages from the calling task, without waiting and without a
        checkpoint, when nothing else is writing: whether they were taken. Taken means the
        socket took them, or took part and the rest waits in the carry, which the next write
        under the lock (`flush_carry`, or any other) writes first. Not taken (nothing was
        written): the lock is held, the socket is closing, a carry is already waiting, the
        batch is larger than one write, or the stream cannot be written this way or failed;
        the caller then leaves the messages to its awaited writes, which meet any failure."""
        if self._write_lock.locked() or self._close_reason is not None or self._carry:
            return False
        parts: list[bytes] = []
        size = 0
        for message in messages:
            header, payload, _ = frame_message(message)
            parts.append(header)
            parts.append(payload)
            size += len(payload)
        if size > WRITE_BATCH_MAX_BYTES:
            return False
        data = b"".join(parts)
        written = self._io.write_now(data)
        if not written:  # None (failed, or not a socket) or 0 (full): nothing was written
            return False
        self._carry = data[written:]
        return True

    async def flush_carry(self, deadline_scope: trio.CancelScope | None = None, write_timeout_s: float = 0.0) -> None:
        """Write what `write_now` left in the carry, within the write timeout as any write
        (the wait for the lock included: another task, a pong say, may be writing it)."""
        if self._carry:
            await self._write(b"", deadline_scope, write_timeout_s)

    async def _write_carry(self, arm: Callable[[], None] | None) -> None:
        """The carry, under the lock. What the socket has not taken stays in the carry until
        it has, so a write cut short here (a ping's own timeout, a cancellation) leaves the
        rest for the next write under the lock: the frame is finished, never followed by
        other bytes, and `carrying` stays true until its last byte is written. (A stream
        that is not a socket only ever carries a control frame: written whole.)"""
        if not self._io.socket_backed:
            carry, self._carry = self._carry, b""
            await self._io.send_all(carry, arm)
            return
        while self._carry:
            written = self._io.write_now(self._carry)
            if written is None:
                raise trio.BrokenResourceError("socket connection broken")
            if written:
                self._carry = self._carry[written:]
                continue
            if arm is not None:
                arm()
            await self._io.wait_writable()

    async def _write(
        self,
        chunk: bytes,
        deadline_scope: trio.CancelScope | None = None,
        write_timeout_s: float = 0.0,
        *,
        more: bytes = b"",
        control: Event | None = None,
    ) -> None:
        """One write under the write lock: the carry (`write_now`), then data frames (`chunk`,
        then `more`), or the control frame `control`, which wsproto frames only once the lock
        is held: nothing is framed or written after a close frame that took the lock first.
        With `deadline_scope`, the write timeout is set on it when the write first has to wait
        (for the lock, or for room in the socket), from then: a write the socket takes at once
        cannot time out, and setting a deadline is not free (trio re-registers the scope)."""
        arm: Callable[[], None] | None = None
        if deadline_scope is not None:
            scope = deadline_scope
            armed = False

            def arm() -> None:  # once per write, at its first wait
                nonlocal armed
                if not armed:
                    armed = True
                    scope.deadline = trio.current_time() + write_timeout_s

        lock = self._write_lock
        try:
            # A free lock is taken without a checkpoint (the usual case: only the socket's
            # reader writes besides the sender, a pong or a close): `async with` would yield
            # first, one more pass of the event loop on the way of every write.
            lock.acquire_nowait()
        except trio.WouldBlock:
            if arm is not None:
                arm()
            await lock.acquire()
        try:
            if self._carry:
                await self._write_carry(arm)
            # Looked at under the lock: a close written while this write waited for the lock
            # ends what may be written.
            if control is not None:
                if self._stream_closed or not _may_send(self._wsproto.state, control):
                    raise ConnectionClosed(self._close_reason)
                # Through the carry: a ping or pong cut short by its caller's bound (the
                # keepalive's) leaves the rest of its frame to the next write, which finishes
                # it before anything else. (A data write cut short is the sender's stall: the
                # socket is closed after it.)
                self._carry = self._wsproto.send(control)
                await self._write_carry(arm)
                return
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            if chunk:
                await self._io.send_all(chunk, arm)
            if more:
                await self._io.send_all(more, arm)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._abort()
            raise ConnectionClosed(self._close_reason) from None
        finally:
            lock.release()

    async def _send_control(self, event: Event) -> None:
        """A control frame, framed by wsproto (which keeps the close state) under the write
        lock and written at once; ConnectionClosed when the close state no longer allows it."""
        await self._write(b"", control=event)

    # --- ping and close ----------------------------------------------------------------

    async def ping(self) -> None:
        """Send a ping and return when its pong (or a later one) arrives. While no other task
        reads, this one does (reading ahead at most READ_AHEAD_MESSAGES messages). No timeout
        of its own: the caller bounds the wait."""
        if self._close_reason is not None:
            raise ConnectionClosed(self._close_reason)
        payload = os.urandom(4)
        while payload in self._pings:
            payload = os.urandom(4)
        pong = trio.Event()
        self._pings[payload] = pong
        try:
            await self._send_control(Ping(payload=payload))
            while not pong.is_set():
                if self._close_reason is not None:
                    raise ConnectionClosed(self._close_reason)
                if self._reading or len(self._messages) >= READ_AHEAD_MESSAGES:
                    await self._read_done.wait()
                else:
                    await self._read(queue_bound=READ_AHEAD_MESSAGES)
        finally:
            self._pings.pop(payload, None)

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str | None = None) -> None:
        """Close: send a close frame with `code` and `reason`, wait for the peer's, close the
        stream. The caller bounds the wait (a peer that never answers keeps it waiting); the
        stream is closed however this ends. Closing a closed socket does nothing."""
        if self._close_reason is not None:
            return
        try:
            if self._wsproto.state is ConnectionState.OPEN:
                self._discarding = True
                # As trio-websocket: ours until the peer's close says otherwise.
                self._close_reason = CloseReason(CLOSE_NORMAL, None)
                await self._send_control(CloseConnection(code=code, reason=reason))
                while not self._close_handshake.is_set():
                    await self._read()
        except ConnectionClosed:
            pass
        finally:
            await self._close_stream()

    async def _close_stream(self) -> None:
        if self._stream_closed:
            return
        self._stream_closed = True
        try:
            await self._io.aclose()
        except trio.BrokenResourceError:
            pass  # the connection was already gone

