"""The daemon's own server WebSocket (`websocket.py`) against a real client: the 101 is
what wsproto writes, messages go both ways over TCP and unix sockets, pings are answered
(also while the socket's task is busy elsewhere), closes carry their codes both ways, a
message over the limit is 1009, a lost stream 1006, a protocol error 1002, frames sent with
the head are the first messages, and a read cut short by a cancellation loses nothing."""

from __future__ import annotations

import base64
import socket as stdlib_socket
import struct

import pytest
import trio
import trio.testing
import trio_websocket
from wsproto.connection import ConnectionType
from wsproto.events import AcceptConnection, Request
from wsproto.frame_protocol import FrameProtocol
from wsproto.handshake import H11Handshake

from sandbox_supervisor.daemon.websocket import (
    CLOSE_ABNORMAL,
    CLOSE_MESSAGE_TOO_BIG,
    READ_AHEAD_MESSAGES,
    ConnectionClosed,
    accept_response,
)
from tests.ws_support import DEADLINE_S, accept_websocket, server_websocket_pair

PROTOCOL_ERROR = 1002


def _head(key: bytes) -> bytes:
    return (
        b"GET /v1/control HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )


@pytest.mark.parametrize("key", [b"dGhlIHNhbXBsZSBub25jZQ==", base64.b64encode(bytes(range(16)))])
def test_the_101_is_byte_for_byte_what_wsproto_answers(key):
    handshake = H11Handshake(ConnectionType.SERVER)
    handshake.receive_data(_head(key))
    (request,) = list(handshake.events())
    assert isinstance(request, Request)
    assert accept_response(key) == handshake.send(AcceptConnection())


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_messages_go_both_ways(transport, tmp_path):
    unix_path = tmp_path / "control.sock" if transport == "unix" else None
    async with server_websocket_pair(unix_path=unix_path) as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    await client.send_message('{"kind":"é ✓ 😀"}')
                    await client.send_message(b"\x00\x01binary")
                    await client.send_message("x" * 200_000)  # more than one read, a 64-bit length

                nursery.start_soon(send)
                assert await ws.get_message() == '{"kind":"é ✓ 😀"}'
                assert await ws.get_message() == b"\x00\x01binary"
                assert await ws.get_message() == "x" * 200_000
            await ws.send_messages(["one", b"two", "three" * 30_000])
            assert [await client.get_message() for _ in range(3)] == ["one", b"two", "three" * 30_000]
            assert ws.closed is None


async def test_a_ping_from_the_peer_is_answered_while_the_socket_reads():
    async with server_websocket_pair() as (ws, _io, client):
        async with trio.open_nursery() as nursery:
            received: list[str | bytes] = []

            async def read_one() -> None:
                received.append(await ws.get_message())

            nursery.start_soon(read_one)
            with trio.fail_after(DEADLINE_S):
                await client.ping(b"are you there")  # returns on the pong
                await client.send_message("after the ping")
        assert received == ["after the ping"]


async def test_our_ping_reads_its_pong_itself_while_the_socket_task_is_busy():
    """No task is in get_message (the socket's task waits for a call slot, say): the ping
    reads the stream itself, and the messages it reads on the way are kept, in order."""
    async with server_websocket_pair() as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            await client.send_message("sent before the ping")
            await ws.ping()
            await client.send_message("sent after the pong")
            assert await ws.get_message() == "sent before the ping"
            assert await ws.get_message() == "sent after the pong"


async def test_our_ping_waits_for_the_socket_tasks_read_when_that_task_is_reading():
    async with server_websocket_pair() as (ws, _io, client):
        received: list[str | bytes] = []
        async with trio.open_nursery() as nursery:

            async def read_two() -> None:
                received.append(await ws.get_message())
                received.append(await ws.get_message())

            nursery.start_soon(read_two)
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(DEADLINE_S):
                await client.send_message("first")
                await ws.ping()  # the reading task sees the pong; this one is woken by its read
                await client.send_message("second")
        assert received == ["first", "second"]


async def test_a_ping_reads_ahead_no_more_than_its_bound_for_a_busy_socket_task():
    """While the queue holds READ_AHEAD_MESSAGES unread messages, a ping does not read: it
    waits for the socket's task (which here never comes back, so the ping times out)."""
    async with server_websocket_pair() as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            for n in range(READ_AHEAD_MESSAGES):
                await client.send_message(f"m{n}")
            while len(ws._messages) < READ_AHEAD_MESSAGES:  # read by pings of our own
                with trio.move_on_after(0.05):
                    await ws.ping()
            await client.send_message("one more")
            with trio.move_on_after(0.2) as waited:
                await ws.ping()
            assert waited.cancelled_caught  # its pong lies behind a read it may not make
            assert len(ws._messages) == READ_AHEAD_MESSAGES
            assert [await ws.get_message() for _ in range(READ_AHEAD_MESSAGES + 1)] == [
                f"m{n}" for n in range(READ_AHEAD_MESSAGES)
            ] + ["one more"]


async def test_the_peers_close_is_seen_with_its_code_and_answered():
    async with server_websocket_pair() as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            await client.send_message("last words")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.aclose, 4400, "rejection received")
                assert await ws.get_message() == "last words"  # what came before the close
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
        assert closed.value.reason is not None
        assert (closed.value.reason.code, closed.value.reason.reason) == (4400, "rejection received")
        assert ws.closed == closed.value.reason
        assert client.closed is not None and client.closed.code == 4400  # the handshake finished
        with pytest.raises(ConnectionClosed):
            await ws.send_message("too late")


async def test_our_close_reaches_the_peer_with_its_code():
    async with server_websocket_pair() as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            await ws.aclose(4001, "superseded by a newer connection")
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await client.get_message()
        assert closed.value.reason.code == 4001
        assert closed.value.reason.reason == "superseded by a newer connection"
        assert ws.closed is not None and ws.closed.code == 4001  # the peer's answer echoes it
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def test_a_message_over_the_limit_closes_with_1009():
    async with server_websocket_pair(max_message_size=1000) as (ws, _io, client):
        with trio.fail_after(DEADLINE_S):
            await client.send_message("y" * 1001)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason is not None and closed.value.reason.code == CLOSE_MESSAGE_TOO_BIG
            with pytest.raises(trio_websocket.ConnectionClosed) as peer:
                await client.get_message()
        assert peer.value.reason.code == CLOSE_MESSAGE_TOO_BIG


async def test_a_stream_lost_without_a_close_is_1006():
    async with server_websocket_pair() as (ws, _io, client):
        sock = client._stream.socket
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, no close frame
        with trio.fail_after(DEADLINE_S), pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason is not None and closed.value.reason.code == CLOSE_ABNORMAL
        with pytest.raises(ConnectionClosed):
            await ws.send_message("nobody listens")


async def _raw_client(first_write: bytes) -> tuple[trio.SocketStream, trio.SocketStream, trio.SocketListener]:
    """A client that writes `first_write` (a head, and whatever follows it) in one write; the
    server's accepted stream."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    client = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
    await client.send_all(first_write)
    server = await listener.accept()
    assert isinstance(server, trio.SocketStream)
    return client, server, listener


async def test_frames_sent_with_the_head_are_the_first_messages():
    framer = FrameProtocol(client=True, extensions=[])
    frames = bytes(framer.send_data("pipelined", True)) + bytes(framer.send_data("second", True))
    client, server, listener = await _raw_client(_head(b"dGhlIHNhbXBsZSBub25jZQ==") + frames)
    try:
        with trio.fail_after(DEADLINE_S):
            ws, _io = await accept_websocket(server)
            assert await ws.get_message() == "pipelined"
            assert await ws.get_message() == "second"
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await client.receive_some(4096)
        assert answer.startswith(b"HTTP/1.1 101 ")
    finally:
        await client.aclose()
        await server.aclose()
        await listener.aclose()


async def test_an_unmasked_frame_from_the_client_is_a_protocol_error():
    server_framer = FrameProtocol(client=False, extensions=[])  # frames that are not masked
    client, server, listener = await _raw_client(_head(b"dGhlIHNhbXBsZSBub25jZQ=="))
    try:
        with trio.fail_after(DEADLINE_S):
            ws, _io = await accept_websocket(server)
            await client.send_all(bytes(server_framer.send_data("not masked", True)))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await client.receive_some(4096)
            rest = answer.split(b"\r\n\r\n", 1)[1]
            while (more := await client.receive_some(4096)):  # then the stream ends
                rest += more
        assert closed.value.reason is not None and closed.value.reason.code == PROTOCOL_ERROR
        # The client is told: a close frame with that code (a server's, unmasked).
        assert rest[0] == 0x88 and int.from_bytes(rest[2:4], "big") == PROTOCOL_ERROR
    finally:
        await client.aclose()
        await server.aclose()
        await listener.aclose()


async def test_a_read_cut_short_while_answering_a_ping_loses_no_message():
    """The ping and a message arrive in one read; answering the ping waits for the write lock
    (the sender holds it) and the read is cancelled there. The message is still returned by
    the next get_message, without the client sending anything more."""
    framer = FrameProtocol(client=True, extensions=[])
    client, server, listener = await _raw_client(_head(b"dGhlIHNhbXBsZSBub25jZQ=="))
    try:
        with trio.fail_after(DEADLINE_S):
            ws, _io = await accept_websocket(server)
            await ws._write_lock.acquire()  # a write under way
            await client.send_all(bytes(framer.ping(b"p")) + bytes(framer.send_data("behind the ping", True)))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ws.get_message)
                await trio.testing.wait_all_tasks_blocked()  # waiting for the lock, to answer
                nursery.cancel_scope.cancel()
            ws._write_lock.release()
            assert await ws.get_message() == "behind the ping"
    finally:
        await client.aclose()
        await server.aclose()
        await listener.aclose()



async def test_a_serving_daemon_never_loads_trio_websocket(tmp_path):
    """The daemon's control sockets are its own (the reference client still uses
    trio-websocket): a `serve` daemon that accepts a session over TCP and over its unix
    socket imports neither trio-websocket nor its dependencies (about 2 MiB of idle memory).
    PYTHONPROFILEIMPORTTIME makes the daemon list every module it imports in its log."""
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d")
    async with running_daemon(layout, env={"PYTHONPROFILEIMPORTTIME": "1"}) as process:
        for generation, endpoint in enumerate(process.running.endpoints, start=1):  # TCP, then unix
            client = process.running.client(endpoint)
            async with client.connect(generation=generation) as session:
                state = await session.bootstrap(cwd=str(layout.workspace))
                assert state["body"]["status"] == "ready"
    imported = [line.split("|")[-1].strip() for line in process.log_text().splitlines() if line.startswith("import time:")]
    assert "sandbox_supervisor.daemon.websocket" in imported  # the probe saw the daemon's imports
    assert not [name for name in imported if name.split(".")[0] == "trio_websocket"]


async def test_a_call_behind_a_refused_frame_is_not_carried_out(tmp_path):
    """A serve daemon, a bootstrapped session, then one write: a frame the daemon must refuse
    (unmasked), and behind it a valid tool.call. The socket closes 1002 and the call never
    runs (RFC 6455, section 7.1.7): a read_file would be answered in the reader's own task,
    so its tool.finished would come before the socket's close in the log."""
    import json
    import uuid

    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d")
    (layout.workspace / "secret.txt").write_text("not for this socket")
    call_id = str(uuid.uuid4())
    tool_call = json.dumps({
        "kind": "tool.call", "connectionGeneration": 1,
        "body": {"tool_name": "read_file", "call_id": call_id, "parameters": {"path": "secret.txt"}},
    })
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            unmasked = FrameProtocol(client=False, extensions=[]).send_data("refused", True)
            behind = FrameProtocol(client=True, extensions=[]).send_data(tool_call, True)
            await session.ws._stream.send_all(bytes(unmasked) + bytes(behind))
            with trio.fail_after(DEADLINE_S):
                while '"socket.closed"' not in process.log_text():
                    await trio.sleep(0.01)
        lines = [json.loads(line) for line in process.log_text().splitlines() if line.startswith("{")]
    closed = [line for line in lines if line.get("event") == "socket.closed"]
    assert [line["code"] for line in closed] == [PROTOCOL_ERROR]
    assert not [line for line in lines if line.get("call_id") == call_id]
