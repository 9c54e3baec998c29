"""Listeners (TCP and unix) and the per-connection front: head, route, gate, upgrade.

Trio lives here: this module moves bytes and owns tasks. What to answer is decided by
`http_front` (routes) and `gate` (upgrades); what to do with an accepted socket is the
`ConnectionApp`'s business.
"""

from __future__ import annotations

import errno
import os
import socket as stdlib_socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import trio
import trio_websocket

from sandbox_supervisor.protocol.addresses import format_host_port, parse_host_port
from sandbox_supervisor.daemon.edge import http_front
from sandbox_supervisor.daemon.auth.gate import Admit, Refuse

log = structlog.get_logger("supervisor.server")

RECEIVE_CHUNK_BYTES = 64 * 1024
# trio-websocket's default 4 KiB receive buffer makes large messages ~3x slower.
WEBSOCKET_RECEIVE_BUFFER_BYTES = 64 * 1024
# Our reader task always waits in get_message, so a small queue keeps pings answered while
# bounding what an unread peer can make us hold.
WEBSOCKET_MESSAGE_QUEUE = 8
# After answering a plain request: half-close, then read (and drop) what the peer still sends
# for at most this long. Closing with unread bytes makes the kernel send RST, and the peer
# sees ECONNRESET instead of our response.
LINGER_AFTER_RESPONSE_S = 0.25
LINGER_MAX_BYTES = 256 * 1024
LISTEN_BACKLOG = 512
UNIX_SOCKET_MODE = 0o600
# How long the check for a live listener on an existing unix socket path may take.
UNIX_PROBE_TIMEOUT_S = 1.0


class ConnectionApp(Protocol):
    """What the front needs from the daemon (the real one is `app.DaemonFront`)."""

    route_paths: http_front.RoutePaths
    handshake_timeout_s: float
    max_message_bytes: int

    def health(self) -> tuple[int, bytes]: ...

    def metrics(self) -> tuple[int, bytes]: ...

    def admit_upgrade(self, head: http_front.RequestHead) -> Admit | Refuse: ...

    async def run_socket(self, ws: trio_websocket.WebSocketConnection, admit: Admit) -> None: ...


class HandshakeSlots:
    """Counts connections between accept and the end of their handshake (head still arriving
    included), so a crowd of slow-loris peers cannot starve real clients of file descriptors
    and memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def try_acquire(self) -> bool:
        if self.in_use >= self.limit:
            return False
        self.in_use += 1
        return True

    def release(self) -> None:
        self.in_use -= 1


class ReplayStream(trio.abc.HalfCloseableStream):
    """Gives wsproto the request head we already read, then the live stream.

    wsproto discards bytes that arrive after the head but before its 101 is sent, so anything
    a pipelining client sent early is held back until the first send (the 101) has gone out.
    """

    def __init__(self, inner: trio.abc.HalfCloseableStream, head: bytes, early: bytes) -> None:
        self._inner = inner
        self._head = head
        self._early = early
        self._sent = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)
        self._sent.set()

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._head:
            data, self._head = self._head, b""
            return data
        if self._early:
            await self._sent.wait()
            data, self._early = self._early, b""
            return data
        return await self._inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _answer_and_close(stream: trio.abc.HalfCloseableStream, response: bytes) -> None:
    """Send a complete response, then close without provoking a reset."""
    try:
        with trio.move_on_after(LINGER_AFTER_RESPONSE_S * 4):
            await stream.send_all(response)
        with trio.move_on_after(LINGER_AFTER_RESPONSE_S):
            await stream.send_eof()
            drained = 0
            while drained < LINGER_MAX_BYTES:
                data = await stream.receive_some(RECEIVE_CHUNK_BYTES)
                if not data:
                    break
                drained += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def handle_stream(stream: trio.abc.HalfCloseableStream, app: ConnectionApp, slots: HandshakeSlots) -> None:
    """One accepted stream, from its first byte to its close. Never raises."""
    if not slots.try_acquire():
        await _answer_and_close(stream, http_front.TOO_MANY_HANDSHAKES_RESPONSE)
        return
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            slots.release()

    try:
        deadline = trio.current_time() + app.handshake_timeout_s
        reader = http_front.HeadReader()
        head = None
        try:
            with trio.fail_at(deadline):
                while head is None:
                    data = await stream.receive_some(RECEIVE_CHUNK_BYTES)
                    head = reader.feed(bytes(data))
        except trio.TooSlowError:
            log.info("http.head_timeout")
            await trio.aclose_forcefully(stream)
            return
        except http_front.HeadTooLarge:
            await _answer_and_close(stream, http_front.HEAD_TOO_LARGE_RESPONSE)
            return
        except http_front.MalformedHead as exc:
            log.info("http.bad_request", reason=str(exc)[:200])
            await _answer_and_close(stream, http_front.BAD_REQUEST_RESPONSE)
            return

        route = http_front.classify(head, app.route_paths)
        if route is http_front.Route.HEALTH:
            status, body = app.health()
            await _answer_and_close(stream, http_front.render_response(status, body))
            return
        if route is http_front.Route.METRICS:
            status, body = app.metrics()
            await _answer_and_close(
                stream,
                http_front.render_response(
                    status, body, content_type=http_front.METRICS_CONTENT_TYPE
                ),
            )
            return
        if route is http_front.Route.BAD_UPGRADE:
            log.info("http.bad_request", reason=http_front.upgrade_framing_defect(head))
            await _answer_and_close(stream, http_front.BAD_REQUEST_RESPONSE)
            return
        if route is http_front.Route.UPGRADE_REQUIRED:
            await _answer_and_close(stream, http_front.UPGRADE_REQUIRED_RESPONSE)
            return
        if route is http_front.Route.NOT_FOUND:
            await _answer_and_close(stream, http_front.NOT_FOUND_RESPONSE)
            return

        decision = app.admit_upgrade(head)
        if isinstance(decision, Refuse):
            await _answer_and_close(
                stream,
                http_front.render_error(
                    decision.status, decision.code, decision.message, decision.extra_headers
                ),
            )
            return

        replay = ReplayStream(stream, reader.head_bytes, reader.trailing)
        async with trio.open_nursery() as ws_nursery:
            try:
                with trio.fail_at(deadline):
                    request = await trio_websocket.wrap_server_stream(
                        ws_nursery,
                        replay,
                        message_queue_size=WEBSOCKET_MESSAGE_QUEUE,
                        max_message_size=app.max_message_bytes,
                        receive_buffer_size=WEBSOCKET_RECEIVE_BUFFER_BYTES,
                    )
                    ws = await request.accept()
            except (trio.TooSlowError, trio_websocket.ConnectionClosed, trio.BrokenResourceError) as exc:
                log.info("websocket.handshake_failed", reason=type(exc).__name__)
                ws_nursery.cancel_scope.cancel()
                await trio.aclose_forcefully(stream)
                return
            release()
            try:
                await app.run_socket(ws, decision)
            finally:
                ws_nursery.cancel_scope.cancel()
                await trio.aclose_forcefully(stream)
    except Exception:  # a bug must cost one connection, never the listener
        log.exception("connection.crashed")
        await trio.aclose_forcefully(stream)
    finally:
        release()


# --- listeners -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BoundListeners:
    listeners: list[trio.SocketListener]
    tcp: list[str]  # "host:port" as bound (port 0 resolved)
    unix: list[str]


async def open_tcp_listener(value: str) -> tuple[list[trio.SocketListener], list[str]]:
    host, port = parse_host_port(value)
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=LISTEN_BACKLOG)
    bound = []
    for listener in listeners:
        sockname = listener.socket.getsockname()
        bound.append(format_host_port(sockname[0], sockname[1]))
    return listeners, bound


# The (device, inode) of every unix socket node this process bound, by path.
_created_unix_nodes: dict[str, tuple[int, int]] = {}


def _remove_stale_unix_socket(path: Path) -> None:
    """Remove a socket file nobody listens on any more (left by a killed daemon). A socket
    someone still accepts on is refused, not taken over: a second daemon started with the
    same path must not cut the first one off (nor delete its socket when it exits)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        # Refusing beats deleting someone's regular file because a config pointed at it.
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    probe.settimeout(UNIX_PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: stale
    except OSError as exc:
        # Cannot tell: a full backlog (EAGAIN, a timeout), a socket of another user (EACCES).
        # Someone may be serving on it; refusing to start is the safe answer.
        raise OSError(
            errno.EADDRINUSE, f"{path} may be in use (connecting to it failed: {exc.strerror or exc})"
        ) from None
    else:
        raise OSError(errno.EADDRINUSE, f"{path} is in use: another process listens on it")
    finally:
        probe.close()
    path.unlink(missing_ok=True)


async def open_unix_listener(path_text: str) -> trio.SocketListener:
    path = Path(path_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_unix_socket(path)
    sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    # umask closes the window between bind() creating the node and chmod() tightening it;
    # the daemon is single-threaded here, so the process-wide umask change is contained.
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, UNIX_SOCKET_MODE)
    sock.listen(LISTEN_BACKLOG)
    node = os.lstat(path)
    # Keyed by the configured text, which is what remove_unix_paths is given at exit.
    _created_unix_nodes[path_text] = (node.st_dev, node.st_ino)
    return trio.SocketListener(sock)


async def open_listeners(tcp: list[str], unix: list[str]) -> BoundListeners:
    listeners: list[trio.SocketListener] = []
    bound_tcp: list[str] = []
    try:
        for value in tcp:
            opened, names = await open_tcp_listener(value)
            listeners.extend(opened)
            bound_tcp.extend(names)
        for path in unix:
            listeners.append(await open_unix_listener(path))
    except BaseException:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise
    return BoundListeners(listeners, bound_tcp, list(unix))


def remove_unix_paths(paths: list[str]) -> None:
    """Remove the socket files this process created, and only those: a path whose node was
    replaced since (another daemon's socket) is left alone."""
    for path in paths:
        try:
            node = os.lstat(path)
            if stat.S_ISSOCK(node.st_mode) and _created_unix_nodes.get(path) == (node.st_dev, node.st_ino):
                os.unlink(path)
        except FileNotFoundError:
            pass


async def serve(
    listeners: list[trio.SocketListener],
    app: ConnectionApp,
    max_handshakes: int,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept until cancelled. Connection tasks live in the nursery passed to
    serve_listeners, so cancelling this call ends them too."""
    slots = HandshakeSlots(max_handshakes)

    async def handler(stream: trio.SocketStream) -> None:
        await handle_stream(stream, app, slots)

    await trio.serve_listeners(handler, listeners, task_status=task_status)
