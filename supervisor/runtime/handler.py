"""The runtime handler: what an attached control socket's frames do after bootstrap.

Every frame is checked before it acts: it must come from the authoritative socket and carry
the fenced generation. A frame that fails validation is answered with an `error` frame (not
journaled) and the socket stays usable. All writes to the socket go through its
`SocketSender`, which first replays the journal after the client's ack floor, then follows
it live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import (
    EventsAckFrame,
    ExecReadOutputFrame,
    ExecSignalFrame,
    FrameError,
    SessionBootstrapFrame,
    ToolCallFrame,
    decode_client_frame,
)
from sandbox_supervisor.daemon.runtime.calls import STALE_FRAME_MESSAGE, CallContext, error_frame
from sandbox_supervisor.daemon.session.sender import SocketSender
from sandbox_supervisor.daemon.session.hub import Connection
from sandbox_supervisor.daemon.state.store import AckAhead

if TYPE_CHECKING:
    from sandbox_supervisor.daemon.app import Supervisor


class RuntimeHandler:
    def __init__(self, sup: Supervisor, conn: Connection, log, sender: SocketSender) -> None:
        self.sup = sup
        self.conn = conn
        self.log = log
        self.sender = sender
        # Built once: a connection's claims are fixed and the bound session does not change;
        # building it per frame was a measurable share of a read_file call.
        self._context: CallContext | None = None

    async def run(self) -> None:
        """Serve frames until the socket closes; the sender runs beside the reader."""
        self.conn.attached = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sender.run)
            while True:
                raw = await self.sup.receive_text(self.conn)
                if raw is None or not await self.handle(raw):
                    break
            nursery.cancel_scope.cancel()

    async def handle(self, raw: str) -> bool:
        """Act on one frame; False when the socket must stop being served."""
        try:
            frame = decode_client_frame(raw)
        except FrameError as exc:
            await self.sender.reply(error_frame(exc.code, exc.message, exc.call_id))
            return True
        if not self._may_act(frame.connectionGeneration):
            await self.sender.reply(error_frame(errors.GENERATION_MISMATCH, STALE_FRAME_MESSAGE))
            return True
        if isinstance(frame, ToolCallFrame):
            generation = frame.connectionGeneration
            await self.sup.calls.submit(
                frame.body, self.context(), self.sender.reply, lambda: self._may_act(generation)
            )
            return True
        if isinstance(frame, EventsAckFrame):
            await self._ack(frame.body.seq)
            return True
        if isinstance(frame, SessionBootstrapFrame):
            if frame.body.sessionId != self.conn.headers.session_id:
                await self.sender.reply(
                    error_frame(errors.INVALID_FRAME, "Bootstrap sessionId does not match the session.")
                )
                return True
            return await self.sup.handle_bootstrap(self.conn, frame, self.log, self.sender.reply)
        if isinstance(frame, (ExecSignalFrame, ExecReadOutputFrame)):
            await self._exec_frame(frame)
            return True
        raise AssertionError(f"unhandled frame kind {frame.kind}")  # the decoder knows no other

    def context(self) -> CallContext:
        if self._context is None:
            self._context = self._build_context()
        return self._context

    def _build_context(self) -> CallContext:
        claims = self.conn.claims
        session = self.sup.session
        assert session is not None  # attached implies bound
        return CallContext(
            session_id=session.sessionId,
            generation=self.conn.generation,
            cwd=session.agent.cwd,
            agent_env=dict(session.agent.env or {}),
            scopes=frozenset(claims.scopes),
            allowed_paths=tuple(claims.allowed_paths) if claims.allowed_paths is not None else None,
            allowed_commands=(
                tuple(claims.allowed_commands) if claims.allowed_commands is not None else None
            ),
        )

    def _may_act(self, generation: int) -> bool:
        return self.conn.attached and generation == self.conn.generation and self.sup.holds_fence(self.conn)

    async def _ack(self, seq: int) -> None:
        try:
            # The client has stored everything up to its floor: those events may go.
            self.sup.journal.acknowledge(seq)
        except AckAhead:
            await self.sender.reply(
                error_frame(errors.ACK_AHEAD, "The ack is above the highest journaled seq.")
            )

    async def _exec_frame(self, frame: ExecSignalFrame | ExecReadOutputFrame) -> None:
        if "shell:exec" not in self.conn.claims.scopes:
            await self.sender.reply(
                error_frame(errors.FORBIDDEN, "The connection lacks the shell:exec scope.", frame.body.call_id)
            )
            return
        await self.sup.exec_frame(frame, self.sender.reply)
