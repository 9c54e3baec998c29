"""The control socket's protocol as a state machine with no I/O (docs/protocol.md §4, §6).

Modelled on h11's `_connection.py`: the socket's task tells the machine what happened — a
decoded frame and the one fact that decides whether it may act (does this socket still hold
the fence), the outcome of a binding, a binary or oversized message, an idle peer, the end
of a rejection — and gets back the actions to carry out. Every rule about what a frame may do
on this socket lives here and is tested as tables (tests/test_control_table.py); the I/O side
(`session.socket`) only moves bytes and runs the actions.

    AWAITING_BOOTSTRAP --bootstrap ok--> BINDING --accepted--> ATTACHED --bootstrap--> BINDING
            |                               |--rejected--> REJECTING --ended--> CLOSED
            '--anything else--> CLOSED      '--persist failed--> CLOSED

Any state goes to CLOSED when a close is requested (superseded, stopping, a socket fault).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.protocol.fields import SESSION_CONTROL
from sandbox_supervisor.protocol.tools import TOOL_SCOPES
from sandbox_supervisor.protocol.bootstrap import BootstrapBody
from sandbox_supervisor.protocol.frames import (
    STALE_FRAME_MESSAGE,
    ClientFrameModel,
    ErrorBody,
    ErrorFrame,
    EventsAckFrame,
    ExecCloseStdinFrame,
    ExecFrame,
    ExecListFrame,
    ExecReadOutputFrame,
    ExecResizeFrame,
    ExecWriteStdinFrame,
    ExecSignalFrame,
    FrameError,
    SessionBootstrapFrame,
    ToolCallFrame,
)

# The scope exec.signal and exec.read_output need: the scope of the command they act on.
EXEC_SCOPE = TOOL_SCOPES["execute_shell_command"]
SESSION_MISMATCH_MESSAGE = "Bootstrap sessionId does not match the session."
EXEC_FORBIDDEN_MESSAGE = "The connection lacks the shell:exec scope."
# Every exec.* frame a client sends: each needs shell:exec (the scope of what it acts on).
EXEC_FRAMES = (
    ExecSignalFrame,
    ExecReadOutputFrame,
    ExecWriteStdinFrame,
    ExecCloseStdinFrame,
    ExecResizeFrame,
    ExecListFrame,
)
ACK_FORBIDDEN_MESSAGE = "events.ack needs the session:control scope; the ack floor did not move."
BIND_FORBIDDEN_MESSAGE = "Binding or rebinding the session needs the session:control scope; nothing changed."


class ChannelState(enum.Enum):
    AWAITING_BOOTSTRAP = "awaiting_bootstrap"
    BINDING = "binding"  # a bootstrap is being decided and persisted (no frame is read meanwhile)
    ATTACHED = "attached"
    REJECTING = "rejecting"  # session.bootstrap.rejected sent; waiting for the client's 4400
    CLOSED = "closed"


class LocalProtocolError(Exception):
    """The daemon fed the machine an event its state cannot take: a bug here, never the peer's
    doing (as h11's LocalProtocolError)."""


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """Send a frame that is not journaled (an `error`, for now)."""

    frame: ErrorFrame


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Bind:
    """Decide the bootstrap against the binding (session.binding), persist a new one, and
    report the outcome with `binding_decided`. `may_bind`: the socket holds session:control."""

    body: BootstrapBody
    may_bind: bool


@dataclass(frozen=True, slots=True)
class SendReadiness:
    """Send `runtime.state` for the bound session; the socket is attached from now on."""

    body: BootstrapBody
    newly_bound: bool
    persist_ms: float  # the `bootstrap-persisted` stage's duration, logged once this is sent


@dataclass(frozen=True, slots=True)
class Reject:
    """Send `session.bootstrap.rejected`, wait for the receipt, terminate the daemon; then
    report with `rejection_finished`."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class SubmitCall:
    body: dict[str, Any]
    generation: int


@dataclass(frozen=True, slots=True)
class Acknowledge:
    seq: int


@dataclass(frozen=True, slots=True)
class RunExec:
    frame: ExecFrame


Action = Reply | Close | Bind | SendReadiness | Reject | SubmitCall | Acknowledge | RunExec


# --- binding outcomes (what `Bind` found) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bound:
    body: BootstrapBody
    newly_bound: bool
    persist_ms: float  # the `bootstrap-persisted` stage's duration (nothing written: about 0)


@dataclass(frozen=True, slots=True)
class BindRefused:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class BindFailed:
    """The binding could not be persisted (the state database refused)."""


@dataclass(frozen=True, slots=True)
class BindNotAllowed:
    """It would bind or rebind the session, and the socket lacks session:control: refused,
    nothing persisted, nothing terminated."""


BindOutcome = Bound | BindRefused | BindFailed | BindNotAllowed


def error_reply(code: str, message: str, call_id: str | None = None, request_id: str | None = None) -> Reply:
    return Reply(ErrorFrame(body=ErrorBody(code=code, message=message, call_id=call_id, request_id=request_id)))


def request_id_of(frame: ClientFrameModel) -> str | None:
    """The client-chosen request id of an exec.* frame (echoed in whatever answers it)."""
    return frame.body.request_id if isinstance(frame, EXEC_FRAMES) else None


class ControlChannel:
    """One control socket's state: what it may do next. Knows the socket's own routing
    facts (session, generation, scopes); learns the rest as events."""

    def __init__(self, session_id: str, generation: int, scopes: Iterable[str]) -> None:
        self.session_id = session_id
        self.generation = generation
        self.scopes = frozenset(scopes)
        self.state = ChannelState.AWAITING_BOOTSTRAP
        # Whether the bootstrap being decided came on an attached socket (§5.5): a refusal
        # then leaves it attached; on a first frame it ends the socket.
        self._rebinding = False

    # --- events ----------------------------------------------------------------------

    def receive_frame(self, frame: ClientFrameModel | FrameError, *, holds_fence: bool) -> list[Action]:
        """A text message was decoded (or failed to decode). `holds_fence`: this socket is
        the authoritative one and its generation is the fenced one (docs/protocol.md §4)."""
        if self.state is ChannelState.AWAITING_BOOTSTRAP:
            return self._first_frame(frame, holds_fence)
        if self.state is ChannelState.ATTACHED:
            return self._attached_frame(frame, holds_fence)
        if self.state is ChannelState.REJECTING:
            return []  # only the client's close counts now
        if self.state is ChannelState.CLOSED:
            return []  # the socket is closing: nothing it sent acts any more
        raise LocalProtocolError(f"a frame arrived in state {self.state.value}")

    def receive_binary(self) -> list[Action]:
        return self._close(closes.CLOSE_UNSUPPORTED_DATA, closes.BINARY_REASON)

    def receive_oversized(self) -> list[Action]:
        return self._close(closes.CLOSE_MESSAGE_TOO_BIG, closes.TOO_BIG_REASON)

    def idle(self) -> list[Action]:
        """No inbound traffic (pongs included) for the idle timeout."""
        return self._close(closes.CLOSE_INTERNAL_ERROR, closes.IDLE_REASON)

    def binding_decided(self, outcome: BindOutcome) -> list[Action]:
        if self.state is ChannelState.CLOSED:
            return []  # closed while the binding was decided (superseded, stopping)
        if self.state is not ChannelState.BINDING:
            raise LocalProtocolError(f"a binding outcome arrived in state {self.state.value}")
        if isinstance(outcome, Bound):
            self.state = ChannelState.ATTACHED
            return [SendReadiness(outcome.body, outcome.newly_bound, outcome.persist_ms)]
        if isinstance(outcome, BindRefused):
            self.state = ChannelState.REJECTING
            return [Reject(outcome.code, outcome.message)]
        if isinstance(outcome, BindNotAllowed):
            refusal = error_reply(errors.FORBIDDEN, BIND_FORBIDDEN_MESSAGE)
            if self._rebinding:
                self.state = ChannelState.ATTACHED
                return [refusal]
            return [refusal, *self._close(closes.CLOSE_POLICY_VIOLATION, closes.BIND_FORBIDDEN_REASON)]
        return self._close(closes.CLOSE_INTERNAL_ERROR, closes.INTERNAL_REASON)

    def readiness_failed(self) -> list[Action]:
        """runtime.state could not be sent."""
        return self._close(closes.CLOSE_INTERNAL_ERROR, closes.SEND_FAILED_REASON)

    def state_unavailable(self) -> list[Action]:
        """The state database could not be read for an answer this socket needs (the
        snapshot behind runtime.state): the socket cannot go on."""
        return self._close(closes.CLOSE_INTERNAL_ERROR, closes.INTERNAL_REASON)

    def rejection_finished(self, *, rejection_sent: bool, peer_closed: bool) -> list[Action]:
        """The rejection ended: sent or not, and closed by the client (with whatever code)
        or not within the receipt timeout."""
        if not rejection_sent:
            return self._close(closes.CLOSE_INTERNAL_ERROR, closes.SEND_FAILED_REASON)
        if peer_closed:
            self.state = ChannelState.CLOSED
            return []  # the peer closed: nothing is left to send
        return self._close(closes.CLOSE_INTERNAL_ERROR, closes.RECEIPT_NOT_OBSERVED_REASON)

    def close_requested(self) -> None:
        """Superseded, stopping, or the socket failed: from now on no frame acts."""
        self.state = ChannelState.CLOSED

    # --- facts -----------------------------------------------------------------------

    def may_act(self, generation: int, *, holds_fence: bool) -> bool:
        """A frame with this generation may take effect now (checked again by a call that
        waited for an in-flight slot: a newer upgrade may have passed the gate meanwhile)."""
        return self.state is ChannelState.ATTACHED and generation == self.generation and holds_fence

    # --- transitions -----------------------------------------------------------------

    def _close(self, code: int, reason: str) -> list[Action]:
        if self.state is ChannelState.CLOSED:
            return []
        self.state = ChannelState.CLOSED
        return [Close(code, closes.clip_close_reason(reason))]

    def _first_frame(self, frame: ClientFrameModel | FrameError, holds_fence: bool) -> list[Action]:
        if not isinstance(frame, SessionBootstrapFrame):
            return self._close(closes.CLOSE_PROTOCOL_ERROR, closes.EXPECTED_BOOTSTRAP_REASON)
        if frame.body.sessionId != self.session_id or frame.connectionGeneration != self.generation:
            return self._close(closes.CLOSE_POLICY_VIOLATION, closes.BOOTSTRAP_MISMATCH_REASON)
        if not holds_fence:
            # A newer upgrade passed the gate while this socket was silent (its own 101 may
            # never have completed, so nothing superseded this one yet): a fenced-out attempt
            # must not bind the session, nor terminate it with a mismatched body.
            return self._close(closes.CLOSE_POLICY_VIOLATION, closes.SUPERSEDED_REASON)
        self.state = ChannelState.BINDING
        self._rebinding = False
        return [Bind(frame.body, may_bind=SESSION_CONTROL in self.scopes)]

    def _attached_frame(self, frame: ClientFrameModel | FrameError, holds_fence: bool) -> list[Action]:
        if isinstance(frame, FrameError):
            return [error_reply(frame.code, frame.message, frame.call_id, frame.request_id)]
        if not self.may_act(frame.connectionGeneration, holds_fence=holds_fence):
            return [error_reply(errors.GENERATION_MISMATCH, STALE_FRAME_MESSAGE, request_id=request_id_of(frame))]
        if isinstance(frame, ToolCallFrame):
            return [SubmitCall(frame.body, frame.connectionGeneration)]
        if isinstance(frame, EventsAckFrame):
            if SESSION_CONTROL not in self.scopes:
                # Pruning deletes what the control plane may not have stored yet: only the
                # session's own authority may do it (§9).
                return [error_reply(errors.FORBIDDEN, ACK_FORBIDDEN_MESSAGE)]
            return [Acknowledge(frame.body.seq)]
        if isinstance(frame, SessionBootstrapFrame):
            if frame.body.sessionId != self.session_id:
                return [error_reply(errors.INVALID_FRAME, SESSION_MISMATCH_MESSAGE)]
            # Re-checked against the binding: the same body answers runtime.state again, any
            # other body is a conflicting claim and is rejected (docs/protocol.md §5.5).
            self.state = ChannelState.BINDING
            self._rebinding = True
            return [Bind(frame.body, may_bind=SESSION_CONTROL in self.scopes)]
        if isinstance(frame, EXEC_FRAMES):
            if EXEC_SCOPE not in self.scopes:
                call_id = None if isinstance(frame, ExecListFrame) else frame.body.call_id
                return [error_reply(errors.FORBIDDEN, EXEC_FORBIDDEN_MESSAGE, call_id, frame.body.request_id)]
            return [RunExec(frame)]
        raise LocalProtocolError(f"unhandled frame kind {frame.kind}")  # the decoder knows no other
