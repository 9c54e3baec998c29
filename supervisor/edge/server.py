"""Listeners (TCP and unix) and the per-connection front: head, route, gate, upgrade.

Trio lives here: this module moves bytes and owns tasks. What to answer is decided by
`http_front` (routes) and `gate` (upgrades); what to do with an accepted socket is the
`ConnectionApp`'s business.
"""

from __future__ import annotations

import errno
import os
import random
import socket as stdlib_socket
import stat
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
import trio

from sandbox_supervisor.protocol.addresses import format_host_port, parse_host_port
from sandbox_supervisor.daemon.edge import http_front
from sandbox_supervisor.daemon.websocket import ServerWebSocket, StreamIO, accept_response
from sandbox_supervisor.daemon.auth.gate import Admit, Refuse, attempt_ids

log = structlog.get_logger("supervisor.server")

# What one read of a request head (or of what is drained after a response) asks for.
RECEIVE_CHUNK_BYTES = 64 * 1024
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

    def ready(self) -> tuple[int, bytes]: ...

    def metrics(self) -> tuple[int, bytes]: ...

    def admit_upgrade(self, head: http_front.RequestHead) -> Admit | Refuse: ...

    async def run_socket(self, ws: ServerWebSocket, admit: Admit) -> None: ...


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


# --- pre-authentication budgets ----------------------------------------------------------
#
# Nothing a peer without a key can do may lock the control plane (or health checks) out.
# Each listener kind has its own pool of handshake slots, TCP peers are limited per source
# address, new TCP connections are dropped at random as the pool fills, and health/metrics
# have a small pool of their own for when the handshake pool is exhausted.

# A request line must be complete this soon after accept (the whole head still has
# handshake_timeout_s): an idle connection costs a slot for one second, not ten.
FIRST_LINE_TIMEOUT_S = 1.0
# Random early drop, like sshd's MaxStartups start:rate:full with start at half the pool
# and full at the pool's limit: past `start` pending handshakes a new connection is refused
# with probability `rate`, rising linearly to 1 at `full`.
EARLY_DROP_START_FRACTION = 0.5
EARLY_DROP_RATE = 0.3
# Health and metrics requests that find the handshake pool (or their peer's share) full get
# one of these slots instead, with a short deadline for their whole head: enough for a
# prober, too few and too short-lived for a flood of fake probes to hold the daemon.
PROBE_SLOTS = 8
PROBE_SLOTS_PER_PEER = 2
PROBE_HEAD_TIMEOUT_S = 1.0
# Refused, dropped and timed-out pre-auth connections are counted and logged once per interval.
REFUSAL_SUMMARY_INTERVAL_S = 10.0
# accept(2) errors that say this process or the machine is out of something for a moment
# (EMFILE: our descriptor limit; ENFILE: the system's; ENOBUFS, ENOMEM: kernel memory), not
# that the listener is broken. The pending connection stays in the backlog, so the listener
# waits and tries again instead of ending the daemon. Backing off matters: the listening
# socket stays readable while the error lasts, so an immediate retry would spin.
ACCEPT_EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The first wait after such an error; each further one in a row doubles it, up to the
# maximum, which bounds how long a connection waits after the resource is back.
ACCEPT_BACKOFF_INITIAL_S = 0.1
ACCEPT_BACKOFF_MAX_S = 1.0
# Accept failures are logged like refusals: the first of an interval at once, then one
# summary with the count of the others (at 10 failures a second per listener, one line per
# failure would flood the log exactly when the machine is short of resources).
ACCEPT_FAILURE_SUMMARY_INTERVAL_S = REFUSAL_SUMMARY_INTERVAL_S
# struct ucred (SO_PEERCRED): pid_t pid, uid_t uid, gid_t gid.
PEERCRED_FORMAT = "iII"
PEERCRED_BYTES = struct.calcsize(PEERCRED_FORMAT)


class PeerSlots:
    """Pending handshakes per source address (pure bookkeeping; no sockets)."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self.pending: dict[str, int] = {}

    def try_acquire(self, peer: str) -> bool:
        count = self.pending.get(peer, 0)
        if count >= self.per_peer:
            return False
        self.pending[peer] = count + 1
        return True

    def release(self, peer: str) -> None:
        count = self.pending.get(peer, 0) - 1
        if count > 0:
            self.pending[peer] = count
        else:
            # Forget the address at zero, so the table holds only peers with a pending handshake.
            self.pending.pop(peer, None)


def early_drop(pending: int, *, start: int, rate: float, full: int, draw: Callable[[], float]) -> bool:
    """Whether to refuse a new connection when `pending` handshakes are already in progress.
    Below `start` never; at or past `full` always; between, with a probability rising
    linearly from `rate` to 1. `draw` returns a uniform float in [0, 1)."""
    if pending < start:
        return False
    if pending >= full:
        return True
    probability = rate + (1.0 - rate) * (pending - start) / (full - start)
    return draw() < probability


def default_unix_allowed_uids() -> frozenset[int]:
    """Who may connect over a unix listener unless listen.unix_allowed_uids says otherwise:
    the daemon's own effective uid and root, the users that can read its state and signal it
    anyway, so admitting them opens nothing new."""
    return frozenset({os.geteuid(), 0})


@dataclass(frozen=True, slots=True)
class FrontLimits:
    max_tcp_handshakes: int
    max_unix_handshakes: int
    max_handshakes_per_peer: int
    # Who may connect over a unix listener (listen.unix_allowed_uids).
    unix_allowed_uids: frozenset[int] = field(default_factory=default_unix_allowed_uids)


class Ticket:
    """A taken slot (handshake or probe); release() is idempotent."""

    def __init__(self, probe: bool, release: Callable[[], None]) -> None:
        self.probe = probe
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release = self._release
        if release is not None:
            self._release = None
            release()


class Refusals:
    """Counts of refused, dropped and timed-out pre-auth connections, per reason."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def note(self, reason: str, **detail: int) -> None:
        """Count a refusal. `detail` goes on the first one's log line only (a flood makes one
        line per interval, not one per connection)."""
        if not self.counts:
            # The first of an interval, logged as it happens (the summary follows).
            log.info("http.refused", reason=reason, **detail)
        self.counts[reason] += 1

    def drain(self) -> dict[str, int]:
        counts, self.counts = dict(self.counts), Counter()
        return counts


def next_accept_backoff(previous_s: float | None) -> float:
    """How long to wait after an accept error in ACCEPT_EXHAUSTION_ERRNOS, given the wait
    after the previous one in a row (None: the accept before it succeeded)."""
    if previous_s is None:
        return ACCEPT_BACKOFF_INITIAL_S
    return min(previous_s * 2, ACCEPT_BACKOFF_MAX_S)


class AcceptFailures:
    """Counts of accept errors in ACCEPT_EXHAUSTION_ERRNOS, per errno name, between summaries."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged = False  # the first of this interval has had its line

    def note(self, exc: OSError, backoff_s: float) -> None:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if not self._logged:
            # One JSON line, no traceback: the errno says all there is (the cause is outside
            # the daemon), and the summary counts the rest of the interval.
            self._logged = True
            log.warning("http.accept_failed", errno=name, error=exc.strerror, retry_in_s=backoff_s)
        else:
            self.counts[name] += 1

    def drain(self) -> dict[str, int]:
        """The failures not logged since the last drain; the next one is logged at once."""
        counts, self.counts = dict(self.counts), Counter()
        self._logged = False
        return counts


class FrontBudgets:
    """Which slot, if any, a new connection gets. Pure: the caller says the listener kind
    and the peer's address; `draw` is the random source of early drop."""

    def __init__(self, limits: FrontLimits, draw: Callable[[], float] = random.random) -> None:
        self.tcp = HandshakeSlots(limits.max_tcp_handshakes)
        self.unix = HandshakeSlots(limits.max_unix_handshakes)
        self.tcp_peers = PeerSlots(limits.max_handshakes_per_peer)
        self.probes = HandshakeSlots(PROBE_SLOTS)
        self.probe_peers = PeerSlots(PROBE_SLOTS_PER_PEER)
        self.refusals = Refusals()
        self.unix_allowed_uids = limits.unix_allowed_uids
        self._draw = draw

    def admit_unix_peer(self, uid: int) -> bool:
        """Whether a process running as `uid` may connect over a unix listener; a refusal is
        counted (reason `peer_uid`)."""
        if uid in self.unix_allowed_uids:
            return True
        self.refusals.note("peer_uid", uid=uid)
        return False

    def admit(self, peer: str | None) -> Ticket | None:
        """A slot for a connection from `peer` (an IP address; None on the unix listener), or
        None (refused; the reason is counted)."""
        pool = self.unix if peer is None else self.tcp
        reason = self._handshake_refusal(pool, peer)
        if reason is None:
            return Ticket(False, lambda: self._release(pool, self.tcp_peers, peer))
        if self.probes.in_use < self.probes.limit and (peer is None or self.probe_peers.try_acquire(peer)):
            self.probes.try_acquire()
            return Ticket(True, lambda: self._release(self.probes, self.probe_peers, peer))
        self.refusals.note(reason)
        return None

    def _handshake_refusal(self, pool: HandshakeSlots, peer: str | None) -> str | None:
        # At least 1: a pool of one slot must not drop connections while it is idle.
        start = max(1, int(pool.limit * EARLY_DROP_START_FRACTION))
        if pool.in_use >= pool.limit:
            return "handshakes_full"
        # TCP only: the unix socket's peers are local processes with file access to it.
        if peer is not None and early_drop(
            pool.in_use, start=start, rate=EARLY_DROP_RATE, full=pool.limit, draw=self._draw
        ):
            return "early_drop"
        if peer is not None and not self.tcp_peers.try_acquire(peer):
            return "peer_limit"
        pool.try_acquire()
        return None

    @staticmethod
    def _release(pool: HandshakeSlots, peers: PeerSlots, peer: str | None) -> None:
        pool.release()
        if peer is not None:
            peers.release(peer)


def peer_address(stream: trio.abc.Stream) -> str | None:
    """The peer's IP address on a TCP stream; None on a unix stream (or another kind)."""
    sock = getattr(stream, "socket", None)
    if sock is None or sock.family not in (stdlib_socket.AF_INET, stdlib_socket.AF_INET6):
        return None
    return str(sock.getpeername()[0])


def unix_peer_uid(stream: trio.abc.Stream) -> int | None:
    """The effective uid the peer had when it connected (SO_PEERCRED, recorded by the kernel,
    so the peer cannot lie about it), on a unix stream; None on TCP (or another kind)."""
    sock = getattr(stream, "socket", None)
    if sock is None or sock.family != stdlib_socket.AF_UNIX:
        return None
    creds = sock.getsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_PEERCRED, PEERCRED_BYTES)
    _pid, uid, _gid = struct.unpack(PEERCRED_FORMAT, creds)
    return int(uid)


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


async def handle_stream(stream: trio.abc.HalfCloseableStream, app: ConnectionApp, budgets: FrontBudgets) -> None:
    """One accepted stream, from its first byte to its close. Never raises."""
    try:
        uid = unix_peer_uid(stream)
        peer = peer_address(stream)
    except OSError:  # the peer left before we asked its address
        await trio.aclose_forcefully(stream)
        return
    if uid is not None and not budgets.admit_unix_peer(uid):
        # Closed before a byte is read or a slot is taken, with no answer at all: the peer is
        # a local process that has no business here (the agent's commands, typically), and
        # silence tells it nothing, not even that an HTTP server listens. The operator finds
        # the refusal, with the uid, in the log (http.refused, reason peer_uid). Health is
        # refused too: the check comes before routing.
        await trio.aclose_forcefully(stream)
        return
    ticket = budgets.admit(peer)
    if ticket is None:
        await _answer_and_close(stream, http_front.TOO_MANY_HANDSHAKES_RESPONSE)
        return
    release = ticket.release

    try:
        accepted = trio.current_time()
        deadline = accepted + (PROBE_HEAD_TIMEOUT_S if ticket.probe else app.handshake_timeout_s)
        first_line_deadline = min(deadline, accepted + FIRST_LINE_TIMEOUT_S)
        reader = http_front.HeadReader()
        head = None
        line_done = False
        try:
            while head is None:
                with trio.move_on_at(deadline if line_done else first_line_deadline) as waited:
                    data = await stream.receive_some(RECEIVE_CHUNK_BYTES)
                if waited.cancelled_caught:
                    budgets.refusals.note("head_timeout" if line_done else "first_line_timeout")
                    await trio.aclose_forcefully(stream)
                    return
                # Any LF ends the request line (h11 accepts bare LF too).
                line_done = line_done or b"\n" in data
                head = reader.feed(bytes(data))
        except http_front.HeadTooLarge:
            await _answer_and_close(stream, http_front.HEAD_TOO_LARGE_RESPONSE)
            return
        except http_front.MalformedHead as exc:
            log.info("http.bad_request", reason=str(exc)[:200])
            await _answer_and_close(stream, http_front.BAD_REQUEST_RESPONSE)
            return

        route = http_front.classify(head, app.route_paths)
        if route is http_front.Route.HEALTH or route is http_front.Route.READY:
            status, body = app.health() if route is http_front.Route.HEALTH else app.ready()
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
        if ticket.probe:
            # A probe slot answers health, readiness and metrics only: the handshake pool is full.
            budgets.refusals.note("probe_not_health")
            await _answer_and_close(stream, http_front.TOO_MANY_HANDSHAKES_RESPONSE)
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

        # The head was checked to be what a WebSocket server accepts (http_front): the
        # upgrade is answered here, and the stream is the socket's from now on. What the
        # client sent after its head is its first frames.
        io = StreamIO(stream)
        try:
            with trio.fail_at(deadline):
                await io.send_all(accept_response(http_front.websocket_key(head)))
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # Admitted and recorded (the fence moved), so the line names the attempt.
            log.info("websocket.handshake_failed", reason=type(exc).__name__, **attempt_ids(decision.headers))
            await trio.aclose_forcefully(stream)
            return
        release()
        ws = ServerWebSocket(io, max_message_size=app.max_message_bytes, received=reader.trailing)
        try:
            await app.run_socket(ws, decision)
        finally:
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


# The configuration keys listeners come from: a listener that cannot be opened is reported
# under its key, with its address as configured (README, "Command line").
LISTEN_TCP_KEY = "listen.tcp"
LISTEN_UNIX_KEY = "listen.unix"


class _UnixPathRefused(OSError):
    """The unix socket path is taken; the message names the path and why."""


class ListenerUnavailable(OSError):
    """A configured listener could not be opened: its configuration key, its address as
    configured and why, worded for the operator (`reason`)."""

    def __init__(self, key: str, address: str, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc))
        self.key = key
        self.address = address
        if isinstance(exc, _UnixPathRefused):
            self.reason = str(exc.strerror)  # already names the path
        elif exc.errno == errno.EADDRINUSE:
            self.reason = f"{address} is in use: another process listens on it"
        else:
            self.reason = f"cannot listen on {address}: {exc.strerror or exc}"


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
        raise _UnixPathRefused(errno.EEXIST, f"{path} exists and is not a socket")
    probe = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    probe.settimeout(UNIX_PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: stale
    except OSError as exc:
        # Cannot tell: a full backlog (EAGAIN, a timeout), a socket of another user (EACCES).
        # Someone may be serving on it; refusing to start is the safe answer.
        raise _UnixPathRefused(
            errno.EADDRINUSE, f"{path} may be in use (connecting to it failed: {exc.strerror or exc})"
        ) from None
    else:
        raise _UnixPathRefused(errno.EADDRINUSE, f"{path} is in use: another process listens on it")
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
            try:
                opened, names = await open_tcp_listener(value)
            except OSError as exc:
                raise ListenerUnavailable(LISTEN_TCP_KEY, value, exc) from None
            listeners.extend(opened)
            bound_tcp.extend(names)
        for path in unix:
            try:
                listeners.append(await open_unix_listener(path))
            except OSError as exc:
                raise ListenerUnavailable(LISTEN_UNIX_KEY, path, exc) from None
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


async def _summarise_refusals(refusals: Refusals) -> None:
    """One line per interval with the counts, instead of one line per refused connection."""
    while True:
        await trio.sleep(REFUSAL_SUMMARY_INTERVAL_S)
        counts = refusals.drain()
        if counts:
            # Under one field: the reasons are data, and a line's field names a fixed set.
            log.info("http.refused_summary", interval_s=REFUSAL_SUMMARY_INTERVAL_S, counts=counts)


async def _summarise_accept_failures(failures: AcceptFailures) -> None:
    """One line per interval with the accept errors the first line did not show."""
    while True:
        await trio.sleep(ACCEPT_FAILURE_SUMMARY_INTERVAL_S)
        counts = failures.drain()
        if counts:
            # Under one field: errno names are data (upper case), not field names.
            log.warning("http.accept_failed_summary", interval_s=ACCEPT_FAILURE_SUMMARY_INTERVAL_S, counts=counts)


async def _run_handler(stream: trio.SocketStream, handler: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


async def _accept_loop(
    listener: trio.SocketListener,
    handler_nursery: trio.Nursery,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    failures: AcceptFailures,
) -> None:
    """trio.serve_listeners' loop for one listener, with our own answer to a shortage: it
    waits a fixed 100 ms and logs each error through the `logging` module with its
    traceback (many lines of text per error, none of them JSON, ten a second). Here the wait
    backs off and the log is one JSON line per interval (AcceptFailures). Any other error
    ends the listener, as in trio: it means the listening socket itself is broken."""
    async with listener:
        backoff_s: float | None = None
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_EXHAUSTION_ERRNOS:
                    raise
                backoff_s = next_accept_backoff(backoff_s)
                failures.note(exc, backoff_s)
                await trio.sleep(backoff_s)
                continue
            backoff_s = None
            handler_nursery.start_soon(_run_handler, stream, handler)


async def serve(
    listeners: list[trio.SocketListener],
    app: ConnectionApp,
    limits: FrontLimits,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept until cancelled. Connection tasks live in this call's nursery, so cancelling
    it ends them too."""
    budgets = FrontBudgets(limits)
    failures = AcceptFailures()

    async def handler(stream: trio.SocketStream) -> None:
        await handle_stream(stream, app, budgets)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_summarise_refusals, budgets.refusals)
        nursery.start_soon(_summarise_accept_failures, failures)
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, nursery, handler, failures)
        task_status.started(listeners)
