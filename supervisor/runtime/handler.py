"""The runtime handler: what an attached control socket's frames do after bootstrap.

Every frame is checked before it acts: it must come from the authoritative socket and carry
the fenced generation. A frame that fails validation is answered with an `error` frame (not
journaled) and the socket stays usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import errors
from protocol.frames import (
    ErrorFrame,
    EventsAckFrame,
    FrameError,
    SessionBootstrapFrame,
    decode_client_frame,
    encode_frame,
)
from supervisor.sessions import Connection
from supervisor.store import StoreError

if TYPE_CHECKING:
    from supervisor.app import Supervisor


def error_frame(code: str, message: str, call_id: str | None = None) -> str:
    body = {"code": code, "message": message}
    if call_id is not None:
        body["call_id"] = call_id
    return encode_frame(ErrorFrame.model_validate({"kind": "error", "body": body}))


class RuntimeHandler:
    def __init__(self, sup: Supervisor, conn: Connection, log) -> None:
        self.sup = sup
        self.conn = conn
        self.log = log

    async def run(self) -> None:
        self.conn.attached = True
        while True:
            raw = await self.sup.receive_text(self.conn)
            if raw is None:
                return
            if not await self.handle(raw):
                return

    async def send(self, text: str) -> bool:
        return await self.sup.send_text(self.conn, text)

    async def handle(self, raw: str) -> bool:
        """Act on one frame; False when the socket must stop being served."""
        try:
            frame = decode_client_frame(raw)
        except FrameError as exc:
            return await self.send(error_frame(exc.code, exc.message, exc.call_id))
        if not self._may_act(frame.connectionGeneration):
            return await self.send(
                error_frame(
                    errors.GENERATION_MISMATCH,
                    "The frame's connectionGeneration is not the fenced generation.",
                )
            )
        if isinstance(frame, SessionBootstrapFrame):
            if frame.body.sessionId != self.conn.headers.session_id:
                return await self.send(
                    error_frame(errors.INVALID_FRAME, "Bootstrap sessionId does not match the session.")
                )
            return await self.sup.handle_bootstrap(self.conn, frame, self.log)
        if isinstance(frame, EventsAckFrame):
            return await self._ack(frame.body.seq)
        return await self.send(
            error_frame(errors.UNKNOWN_KIND, f"Frame kind {frame.kind!r} is not served yet.")
        )

    def _may_act(self, generation: int) -> bool:
        if not (self.conn.attached and self.sup.hub.is_authoritative(self.conn)):
            return False
        try:
            fence = self.sup.store.snapshot().fence_generation
        except StoreError:
            return False
        return generation == self.conn.generation == fence

    async def _ack(self, seq: int) -> bool:
        snapshot = self.sup.store.snapshot()
        if seq > snapshot.local_event_max:
            return await self.send(
                error_frame(errors.ACK_AHEAD, "The ack is above the highest journaled seq.")
            )
        self.sup.store.raise_ack_floor(seq)
        return True
