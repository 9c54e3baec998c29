"""A real server WebSocket (the daemon's `ServerWebSocket`) and a real trio-websocket client
over loopback TCP or a unix socket, for tests of what the daemon writes and reads: the head
is read and answered as the edge answers it, and the server's writes are recorded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio_websocket

from sandbox_supervisor.daemon.edge import http_front
from sandbox_supervisor.daemon.websocket import ServerWebSocket, StreamIO, accept_response

DEADLINE_S = 10.0
MAX_MESSAGE_SIZE = 1 << 20


class RecordingIO(StreamIO):
    """The server's stream, direct as in the daemon; every write is recorded as passed
    (`writes`: the objects, so a test can tell a payload written as itself from a copy)."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        super().__init__(stream)
        self.writes: list[bytes | bytearray | memoryview] = []
        self.data = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview, before_wait: Callable[[], None] | None = None) -> None:
        self.writes.append(data)
        self.data += data
        await super().send_all(data, before_wait)

    def write_now(self, data: bytes) -> int | None:
        written = super().write_now(data)
        if written:
            self.writes.append(data[:written])
            self.data += data[:written]
        return written


async def accept_websocket(
    stream: trio.SocketStream, *, max_message_size: int = MAX_MESSAGE_SIZE
) -> tuple[ServerWebSocket, RecordingIO]:
    """What the edge does with an upgrade: read the head, answer it, wrap the stream (with
    whatever came after the head as the first bytes)."""
    reader = http_front.HeadReader()
    head = None
    while head is None:
        head = reader.feed(bytes(await stream.receive_some(65536)))
    assert http_front.is_valid_websocket_handshake(head)
    io = RecordingIO(stream)
    await io.send_all(accept_response(http_front.websocket_key(head)))
    io.writes.clear()
    io.data.clear()
    return ServerWebSocket(io, max_message_size=max_message_size, received=reader.trailing), io


@asynccontextmanager
async def server_websocket_pair(
    *, unix_path: Path | None = None, max_message_size: int = MAX_MESSAGE_SIZE
) -> AsyncIterator[tuple[ServerWebSocket, RecordingIO, trio_websocket.WebSocketConnection]]:
    """(the server's WebSocket, its recorded stream, a trio-websocket client connected to it)."""
    if unix_path is None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    else:
        sock = trio.socket.socket(trio.socket.AF_UNIX)
        await sock.bind(str(unix_path))
        sock.listen()
        listeners = [trio.SocketListener(sock)]
    accepted: list[tuple[ServerWebSocket, RecordingIO]] = []
    ready = trio.Event()
    try:
        async with trio.open_nursery() as nursery:

            async def serve_one() -> None:
                stream = await listeners[0].accept()
                assert isinstance(stream, trio.SocketStream)
                accepted.append(await accept_websocket(stream, max_message_size=max_message_size))
                ready.set()

            nursery.start_soon(serve_one)
            with trio.fail_after(DEADLINE_S):
                if unix_path is None:
                    port = listeners[0].socket.getsockname()[1]
                    client = await trio_websocket.connect_websocket(nursery, "127.0.0.1", port, "/", use_ssl=False)
                else:
                    client_stream = await trio.open_unix_socket(str(unix_path))
                    client = await trio_websocket.wrap_client_stream(nursery, client_stream, "localhost", "/")
                await ready.wait()
            ws, io = accepted[0]
            try:
                yield ws, io, client
            finally:
                # The server closes first: the client's reader answers its close.
                with trio.move_on_after(DEADLINE_S) as closing:
                    closing.shield = True
                    await ws.aclose()
                    await client.aclose()
                nursery.cancel_scope.cancel()
    finally:
        for listener in listeners:
            await listener.aclose()
