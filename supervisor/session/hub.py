"""One authoritative socket per session (docs/protocol.md §4).

`SessionHub` is plain state: which connection is authoritative, and which connections are
still open. Closing sockets is asynchronous, so superseding only *asks* the old connection to
close (its own task does it, inside its own nursery) after detaching it synchronously: from
the moment a newer socket is admitted, no frame of the old one can act.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from sandbox_supervisor.protocol.authority import AssertionClaims
from sandbox_supervisor.protocol.closes import (
    CLOSE_POLICY_VIOLATION,
    SUPERSEDED_REASON,
    clip_close_reason,
)
from sandbox_supervisor.protocol.headers import RoutingHeaders
from sandbox_supervisor.daemon.websocket import ServerWebSocket
from sandbox_supervisor.daemon.session.control import ControlChannel
from sandbox_supervisor.daemon.session.sender import SocketSender


@dataclass(eq=False)
class Connection:
    """An accepted control socket, what the gate learned about it, and its protocol state."""

    ws: ServerWebSocket
    headers: RoutingHeaders
    claims: AssertionClaims
    admission: int = 0  # the gate's admission order (see Admit.admission)
    close_request: tuple[int, str] | None = None
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    last_inbound: float = 0.0
    # Scopes the configuration adds to every assertion (`authority.legacy_session_control`).
    granted: frozenset[str] = frozenset()
    channel: ControlChannel = field(init=False)
    # Once attached: the task that writes the journal to this socket (what a drain flushes).
    sender: SocketSender | None = None

    def __post_init__(self) -> None:
        self.channel = ControlChannel(self.headers.session_id, self.headers.generation, self.scopes)

    @property
    def scopes(self) -> frozenset[str]:
        """What this socket may do: its assertion's scopes and what the configuration grants."""
        return frozenset(self.claims.scopes) | self.granted

    @property
    def generation(self) -> int:
        return self.headers.generation

    def request_close(self, code: int, reason: str) -> None:
        """Ask the connection's own task to close the socket with this code.

        The first request wins: a socket that is being superseded is not re-closed as
        'stopping', and vice versa.
        """
        if self.close_request is None:
            self.close_request = (code, clip_close_reason(reason))
        self.channel.close_requested()
        self.cancel_scope.cancel()


class SessionHub:
    def __init__(self) -> None:
        self.authoritative: Connection | None = None
        self.open: set[Connection] = set()
        self._all_closed = trio.Event()
        self._all_closed.set()

    def admit(self, conn: Connection) -> Connection | None:
        """Make `conn` authoritative; detach and ask the previous one to close (1008).

        A connection admitted *before* the current authoritative one (its handshake simply
        finished later) is already superseded: it is closed instead."""
        previous = self.authoritative
        self.open.add(conn)
        if self._all_closed.is_set():
            self._all_closed = trio.Event()
        if previous is not None and previous.admission > conn.admission:
            conn.request_close(CLOSE_POLICY_VIOLATION, SUPERSEDED_REASON)
            return previous
        self.authoritative = conn
        if previous is not None and previous is not conn:
            previous.request_close(CLOSE_POLICY_VIOLATION, SUPERSEDED_REASON)
        return previous

    def is_authoritative(self, conn: Connection) -> bool:
        return self.authoritative is conn

    def forget(self, conn: Connection) -> None:
        self.open.discard(conn)
        if self.authoritative is conn:
            self.authoritative = None
        if not self.open:
            self._all_closed.set()

    async def wait_all_closed(self) -> None:
        await self._all_closed.wait()

    async def flush_all(self, seq: int) -> None:
        """Wait until every open socket's sender has sent the journal up to `seq` (or has
        stopped). Unbounded: the caller gives it a budget."""
        async with trio.open_nursery() as nursery:
            for conn in list(self.open):
                if conn.sender is not None:
                    nursery.start_soon(conn.sender.flush, seq)

    def close_all(self, code: int, reason: str) -> None:
        for conn in list(self.open):
            conn.request_close(code, reason)
