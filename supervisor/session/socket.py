"""The life of one control socket: receive, send, keepalive, close, supersede.

The rules are `control.ControlChannel`'s; this module is the trio side that moves messages
and carries out the machine's actions. Everything the socket does happens in its own task
and nursery (the reader here, the keepalive, and once attached the journal sender), all
cancelled together when the socket is asked to close.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import trio

from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.protocol.fields import SESSION_CONTROL
from sandbox_supervisor.protocol.frames import (
    BootstrapRejectedBody,
    BootstrapRejectedFrame,
    ClientFrameModel,
    ExecFrame,
    FrameError,
    ServerFrameModel,
    decode_client_frame,
    encode_frame,
)
from sandbox_supervisor.daemon.auth.gate import Admit
from sandbox_supervisor.daemon.websocket import ConnectionClosed, Outgoing, ServerWebSocket
from sandbox_supervisor.daemon.ops.notify import SystemdNotifier
from sandbox_supervisor.daemon.runtime.calls import CallContext, SendReply
from sandbox_supervisor.daemon.session import bootstrap
from sandbox_supervisor.daemon.session.control import (
    Acknowledge,
    Action,
    Bind,
    Bound,
    Close,
    Reject,
    Reply,
    RunExec,
    SendReadiness,
    SubmitCall,
    error_reply,
)
from sandbox_supervisor.daemon.session.hub import Connection, SessionHub
from sandbox_supervisor.daemon.session.sender import SocketSender
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import AckAhead, StateStore, StoreError
from sandbox_supervisor.daemon.state.visibility import Audience
from sandbox_supervisor.daemon.status import DaemonStatus
from sandbox_supervisor.daemon.telemetry import Telemetry

log = structlog.get_logger("supervisor")

# The close handshake of a socket while the daemon serves; while it stops, the drain budget.
CLOSE_HANDSHAKE_TIMEOUT_S = 1.0
# A UTF-8 character is at most this many bytes: a text message of n characters can exceed
# the byte limit only when n * 4 does.
MAX_UTF8_BYTES_PER_CHAR = 4
ACK_AHEAD_MESSAGE = "The ack is above the highest journaled seq."
# How often an ack the store could not record (a full disk) is tried again: short enough that
# pruning resumes soon after space returns, long enough that a full disk costs one failed
# transaction a second.
ACK_RETRY_INTERVAL_S = 1.0

class RuntimePort(Protocol):
    """What the session layer hands to the runtime: tool calls and exec frames. The runtime
    implements it (`runtime.service.Runtime`) and never imports the session."""

    async def submit_call(
        self, body: dict[str, Any], context: CallContext, reply: SendReply, may_act: Callable[[], bool]
    ) -> None: ...

    async def exec_frame(self, frame: ExecFrame, audience: Audience | None = None) -> ServerFrameModel | Outgoing | None: ...

    def audience(
        self,
        scopes: Iterable[str],
        allowed_paths: Sequence[str] | None,
        allowed_commands: Sequence[str] | None,
        cwd: str,
    ) -> Audience: ...


@dataclass(frozen=True, slots=True)
class SocketSettings:
    ping_interval_s: float
    idle_timeout_s: float
    max_message_bytes: int
    drain_budget_s: float
    rejection_receipt_timeout_s: float
    write_timeout_s: float = 60.0  # websocket.write_timeout_s
    # `authority.legacy_session_control`: every assertion holds session:control, as before
    # the scope existed (a transition for control planes that do not grant it yet).
    legacy_session_control: bool = False


@dataclass(frozen=True, slots=True)
class SessionServices:
    """Everything a control socket uses, built once by the app."""

    settings: SocketSettings
    binding_rules: bootstrap.BindingRules
    store: StateStore
    journal: Journal
    hub: SessionHub
    status: DaemonStatus
    runtime: RuntimePort
    notifier: SystemdNotifier
    telemetry: Telemetry | None = None


async def serve_control_socket(ws: ServerWebSocket, admit: Admit, services: SessionServices) -> None:
    granted = frozenset({SESSION_CONTROL}) if services.settings.legacy_session_control else frozenset()
    conn = Connection(
        ws, admit.headers, admit.claims, admission=admit.admission, last_inbound=trio.current_time(), granted=granted
    )
    await ControlSocket(conn, services).run()


class ControlSocket:
    def __init__(self, conn: Connection, services: SessionServices) -> None:
        self.conn = conn
        self.services = services
        self.channel = conn.channel
        self.log = log.bind(
            session_id=conn.headers.session_id, generation=conn.generation, attempt_id=conn.headers.attempt_id
        )
        self.sender: SocketSender | None = None  # once attached: every later write goes through it
        self._nursery: trio.Nursery | None = None
        self._context: CallContext | None = None
        self._audience: Audience | None = None

    # --- the socket's life -----------------------------------------------------------

    async def run(self) -> None:
        conn, services = self.conn, self.services
        services.hub.admit(conn)
        if not services.status.serving:
            # Admitted, then the daemon started stopping before the 101 went out.
            conn.request_close(closes.CLOSE_GOING_AWAY, closes.STOPPING_REASON)
        try:
            with conn.cancel_scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._keepalive)
                    await self._converse()
                    nursery.cancel_scope.cancel()
        except Exception:
            # A bug must cost this socket, never the listener or the session's calls (they
            # run in the daemon's nursery): logged with its traceback, closed 1011.
            self.log.exception("socket.crashed")
            conn.request_close(closes.CLOSE_INTERNAL_ERROR, closes.INTERNAL_REASON)
        finally:
            await self._close()

    async def _close(self) -> None:
        conn, ws = self.conn, self.conn.ws
        code, reason = conn.close_request or (closes.CLOSE_NORMAL, "")
        # While stopping, the close handshake gets only the drain budget.
        timeout = CLOSE_HANDSHAKE_TIMEOUT_S if self.services.status.serving else self.services.settings.drain_budget_s
        with trio.move_on_after(timeout) as scope:
            scope.shield = True
            try:
                await ws.aclose(code, reason)
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the peer may already be gone
        # Forgotten only once closed, so a drain waiting for all sockets waits for this.
        self.services.hub.forget(conn)
        if conn.close_request is None and ws.closed is not None:
            # Closed before we asked: by the peer, or by the WebSocket library itself (1009
            # for a message over its limit). Log that close, not the default we sent.
            code, reason = ws.closed.code, ws.closed.reason or ""
        self.log.info("socket.closed", code=code, reason=reason)

    async def _keepalive(self) -> None:
        """Ping after `ping_interval_s` of inbound silence; close after `idle_timeout_s`.
        A pong counts as inbound traffic, so a live peer is never closed for idleness."""
        settings = self.services.settings
        conn = self.conn
        while True:
            idle_for = trio.current_time() - conn.last_inbound
            if idle_for >= settings.idle_timeout_s:
                self._close_as(self.channel.idle())
                return
            if idle_for < settings.ping_interval_s:
                await trio.sleep(settings.ping_interval_s - idle_for)
                continue
            with trio.move_on_after(settings.idle_timeout_s - idle_for):
                try:
                    await conn.ws.ping()
                except ConnectionClosed:
                    return
                conn.last_inbound = trio.current_time()

    def _close_as(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Close):
                self.conn.request_close(action.code, action.reason)

    async def _receive(self) -> str | None:
        """The next text message, or None when the socket is done (closed, or a binary or
        oversized message, which the channel answers with a close)."""
        try:
            message = await self.conn.ws.get_message()
        except ConnectionClosed:
            return None
        self.conn.last_inbound = trio.current_time()
        if isinstance(message, bytes):
            self._close_as(self.channel.receive_binary())
            return None
        # The WebSocket measures a text message in characters; the limit is in bytes. Only
        # a message that could exceed it is encoded to count.
        limit = self.services.settings.max_message_bytes
        if len(message) * MAX_UTF8_BYTES_PER_CHAR > limit and len(message.encode("utf-8")) > limit:
            self._close_as(self.channel.receive_oversized())
            return None
        return message

    async def _send_now(self, text: Outgoing) -> bool:
        """Write directly (before the sender exists, and for a rejection)."""
        try:
            await self.conn.ws.send_message(text)
            return True
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return False

    def _holds_fence(self) -> bool:
        """The socket is the authoritative one and its generation is the fenced one: only
        then may its frames act (docs/protocol.md §4). A newer upgrade that passed the gate
        moves the fence even when its handshake fails and supersedes nobody."""
        services = self.services
        return services.hub.is_authoritative(self.conn) and self.conn.generation == services.status.fence_generation

    # --- frames ----------------------------------------------------------------------

    async def _converse(self) -> None:
        while True:
            raw = await self._receive()
            if raw is None:
                return
            frame = _decode(raw)
            if not await self._carry_out(self.channel.receive_frame(frame, holds_fence=self._holds_fence())):
                return

    async def _carry_out(self, actions: Sequence[Action]) -> bool:
        """Run the machine's actions in order; False when the socket must stop being served."""
        for action in actions:
            if isinstance(action, Reply):
                await self._reply(encode_frame(action.frame))
            elif isinstance(action, Close):
                self.conn.request_close(action.code, action.reason)
                return False
            elif isinstance(action, SubmitCall):
                await self._submit(action)
            elif isinstance(action, Acknowledge):
                await self._acknowledge(action.seq)
            elif isinstance(action, RunExec):
                answer = await self.services.runtime.exec_frame(action.frame, self._socket_audience())
                if answer is not None:
                    # bytes, or its two parts: a binary exec.output_page, sent as a binary
                    # message (§6.5.1); str: a frame the runtime encoded directly
                    # (exec.stdin_ack).
                    await self._reply(answer if isinstance(answer, (bytes, str, tuple)) else encode_frame(answer))
            elif isinstance(action, Bind):
                services = self.services
                outcome = bootstrap.bind(
                    action.body, services.store, services.status, services.binding_rules, self.log,
                    may_bind=action.may_bind,
                )
                decided = self.channel.binding_decided(outcome)
                if isinstance(outcome, Bound) and not decided:
                    # Closed meanwhile (superseded, stopping): no readiness follows to log with.
                    bootstrap.log_stage(bootstrap.STAGE_PERSISTED, "success", outcome.persist_ms, outcome.body.sessionId)
                if not await self._carry_out(decided):
                    return False
            elif isinstance(action, SendReadiness):
                if not await self._send_readiness(action):
                    return False
            elif isinstance(action, Reject):
                await self._reject(action)
                return False
        return True

    async def _reply(self, text: Outgoing) -> None:
        if self.sender is not None:
            await self.sender.reply(text)
        else:
            await self._send_now(text)

    async def _send_readiness(self, action: SendReadiness) -> bool:
        started = time.monotonic()
        failed: list[Action] | None = None
        sent = False
        try:
            failed = await self._write_readiness(action)
            sent = failed is None
        finally:
            # Both stages' lines, in order, once runtime.state went out or did not (a failed
            # write, the state unreadable, or a cancel: superseded, stopping). The persisted
            # stage is timed by `bootstrap.bind` and logged only here, so that no log write
            # stands between the commit and the frame the client is waiting for.
            readiness_ms = bootstrap.elapsed_ms(started)
            session_id = action.body.sessionId
            bootstrap.log_stage(bootstrap.STAGE_PERSISTED, "success", action.persist_ms, session_id)
            bootstrap.log_stage(bootstrap.STAGE_READINESS_SENT, "success" if sent else "failure", readiness_ms, session_id)
        if failed is not None:
            return await self._carry_out(failed)
        self.log.info("session.attached", newly_bound=action.newly_bound)
        return True

    async def _write_readiness(self, action: SendReadiness) -> list[Action] | None:
        """Send runtime.state (None), or what the channel does when it cannot be sent."""
        services, conn = self.services, self.conn
        try:
            snapshot = services.store.snapshot()
        except StoreError:
            self.log.exception("bootstrap.state_unavailable")
            return self.channel.state_unavailable()
        frame = bootstrap.readiness_frame(
            action.body,
            generation=conn.generation,
            event_ack=conn.headers.event_ack,
            snapshot=snapshot,
            version=services.status.version,
            scopes=sorted(conn.scopes),
        )
        if self.sender is not None:
            # Re-attached on a socket that already has its sender: queued like any reply.
            await self.sender.reply(encode_frame(frame))
        elif not await self._send_now(encode_frame(frame)):
            return self.channel.readiness_failed()
        else:
            self._start_sender()
        return None

    def _start_sender(self) -> None:
        # Replay starts after the floor the client declared in its upgrade; the same cursor
        # then follows the journal live, so the seam cannot skip or repeat an event.
        assert self._nursery is not None
        services = self.services
        self.sender = SocketSender(
            self.conn.ws,
            services.journal,
            cursor=self.conn.headers.event_ack,
            telemetry=services.telemetry,
            audience=self._socket_audience(),
            write_timeout_s=services.settings.write_timeout_s,
            on_stalled=lambda: self.conn.request_close(closes.CLOSE_INTERNAL_ERROR, closes.WRITE_TIMEOUT_REASON),
        )
        self.conn.sender = self.sender
        self._nursery.start_soon(self.sender.run)

    async def _reject(self, action: Reject) -> None:
        """Send the rejection, wait for the receipt (4400), then terminate either way."""
        services, conn = self.services, self.conn
        self.log.warning("bootstrap.rejected", code=action.code)
        frame = BootstrapRejectedFrame(body=BootstrapRejectedBody(code=action.code, message=action.message))
        try:
            if not await self._send_now(encode_frame(frame)):
                self._close_as(self.channel.rejection_finished(rejection_sent=False, peer_closed=False))
                return
            receipt = False
            peer_closed = False
            with trio.move_on_after(services.settings.rejection_receipt_timeout_s):
                try:
                    while True:
                        await conn.ws.get_message()  # anything but the close is ignored now
                except ConnectionClosed as exc:
                    peer_closed = True
                    closed = exc.reason
                    if closed is not None:
                        receipt = (
                            closed.code == closes.CLOSE_REJECTION_RECEIPT
                            and closed.reason == closes.REJECTION_RECEIPT_REASON
                        )
                        # The peer closed: nothing left to send, whatever code it used.
                        if conn.close_request is None:
                            conn.close_request = (closed.code, closed.reason or "")
            self._close_as(self.channel.rejection_finished(rejection_sent=True, peer_closed=peer_closed))
            self.log.info("bootstrap.rejection_receipt", observed=receipt)
        finally:
            # Also when the wait is cut short (the socket superseded, the daemon stopping):
            # the rejection was decided, and it is terminal whatever happens to this socket.
            bootstrap.terminate(services.store, services.status, services.notifier, action.code, action.message)

    async def _submit(self, action: SubmitCall) -> None:
        generation = action.generation
        await self.services.runtime.submit_call(
            action.body,
            self._call_context(),
            self._reply,
            lambda: self.channel.may_act(generation, holds_fence=self._holds_fence()),
        )

    async def _acknowledge(self, seq: int) -> None:
        try:
            # The client has stored everything up to its floor: those events may go.
            self.services.journal.acknowledge(seq)
        except AckAhead:
            await self._carry_out([error_reply(errors.ACK_AHEAD, ACK_AHEAD_MESSAGE)])
        except StoreError as exc:
            # The daemon's fault, not the client's (a full disk): the ack is kept in memory
            # (Journal.deferred_ack) and written by `retry_deferred_acks` once the store takes
            # it. The client is answered as for any ack (nothing); until then nothing it acked
            # is pruned, and a replay may resend what it already has (it drops duplicates).
            self.log.warning("ack.deferred", seq=seq, error=str(exc))

    def _socket_audience(self) -> Audience:
        """What this socket may see (docs/protocol.md §9.1), resolved once: its scopes and
        allowed_paths are fixed, and so is the bound agent.cwd."""
        if self._audience is None:
            session = self.services.status.session
            assert session is not None  # attached implies bound
            claims = self.conn.claims
            self._audience = self.services.runtime.audience(
                self.conn.scopes, claims.allowed_paths, claims.allowed_commands, session.agent.cwd
            )
        return self._audience

    def _call_context(self) -> CallContext:
        # Built once: a connection's claims are fixed and the bound session does not change;
        # building it per frame was a measurable share of a read_file call.
        if self._context is None:
            claims = self.conn.claims
            session = self.services.status.session
            assert session is not None  # attached implies bound
            self._context = CallContext(
                session_id=session.sessionId,
                generation=self.conn.generation,
                cwd=session.agent.cwd,
                agent_env=dict(session.agent.env or {}),
                scopes=self.conn.scopes,
                allowed_paths=tuple(claims.allowed_paths) if claims.allowed_paths is not None else None,
                allowed_commands=tuple(claims.allowed_commands) if claims.allowed_commands is not None else None,
                audience=self._socket_audience(),
            )
        return self._context


async def retry_deferred_acks(journal: Journal, interval_s: float = ACK_RETRY_INTERVAL_S) -> None:
    """Write an ack the store could not record (Journal.deferred_ack) as soon as it can:
    tried every `interval_s`, so a full disk that frees up needs no new ack from the client."""
    while True:
        await trio.sleep(interval_s)
        try:
            floor = journal.retry_deferred_ack()
        except StoreError:
            continue  # still refused: kept, tried again next time
        if floor is not None:
            log.info("ack.recorded", floor=floor)


def _decode(raw: str) -> ClientFrameModel | FrameError:
    try:
        return decode_client_frame(raw)
    except FrameError as exc:
        return exc
