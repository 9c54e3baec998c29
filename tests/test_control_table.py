"""The control socket's state machine (session.control) as tables: a state, an event and the
facts in; the actions and the next state out. No socket, no clock."""

from __future__ import annotations

import pytest

from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.protocol.bootstrap import BootstrapBody
from sandbox_supervisor.protocol.frames import FrameError, decode_client_frame
from sandbox_supervisor.daemon.session.control import (
    Acknowledge,
    Bind,
    BindFailed,
    BindNotAllowed,
    BindRefused,
    Bound,
    ChannelState,
    Close,
    ControlChannel,
    LocalProtocolError,
    Reject,
    Reply,
    RunExec,
    SendReadiness,
    SubmitCall,
)

SESSION = "session-1"
GENERATION = 4
CALL_ID = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21"
BODY = {
    "sessionId": SESSION,
    "agent": {"profile": "default", "cwd": "/home/user"},
    "repositories": [],
}


def frame(kind: str, body: dict, generation: int = GENERATION):
    import json

    return decode_client_frame(json.dumps({"kind": kind, "connectionGeneration": generation, "body": body}))


BOOTSTRAP = frame("session.bootstrap", BODY)
TOOL_CALL = frame("tool.call", {"tool_name": "read_file", "call_id": CALL_ID, "parameters": {"path": "a"}})
ACK = frame("events.ack", {"seq": 3})
SIGNAL = frame("exec.signal", {"call_id": CALL_ID, "signal": "SIGINT"})
READ_OUTPUT = frame("exec.read_output", {"call_id": CALL_ID, "stream": "stdout", "offset": 0, "length": 10})
BAD = FrameError(errors.INVALID_FRAME, "Frame is not valid JSON.")
UNKNOWN = FrameError(errors.UNKNOWN_KIND, "Frame kind is not known.", call_id=CALL_ID)


def channel(
    state: ChannelState = ChannelState.AWAITING_BOOTSTRAP, scopes=("files:read", "shell:exec", "session:control")
) -> ControlChannel:
    machine = ControlChannel(SESSION, GENERATION, scopes)
    machine.state = state
    return machine


def close(code: int, reason: str) -> list:
    return [Close(code, reason)]


# --- the first frame -----------------------------------------------------------------------

FIRST_FRAME = [
    # (frame, holds_fence, actions, next state)
    (BOOTSTRAP, True, [Bind(BootstrapBody.model_validate(BODY), may_bind=True)], ChannelState.BINDING),
    (BOOTSTRAP, False, close(1008, closes.SUPERSEDED_REASON), ChannelState.CLOSED),
    (frame("session.bootstrap", {**BODY, "sessionId": "other"}), True, close(1008, closes.BOOTSTRAP_MISMATCH_REASON), ChannelState.CLOSED),
    (frame("session.bootstrap", BODY, generation=GENERATION + 1), True, close(1008, closes.BOOTSTRAP_MISMATCH_REASON), ChannelState.CLOSED),
    (TOOL_CALL, True, close(1002, closes.EXPECTED_BOOTSTRAP_REASON), ChannelState.CLOSED),
    (ACK, True, close(1002, closes.EXPECTED_BOOTSTRAP_REASON), ChannelState.CLOSED),
    (BAD, True, close(1002, closes.EXPECTED_BOOTSTRAP_REASON), ChannelState.CLOSED),
    (UNKNOWN, True, close(1002, closes.EXPECTED_BOOTSTRAP_REASON), ChannelState.CLOSED),
]


@pytest.mark.parametrize("event, holds_fence, actions, state", FIRST_FRAME)
def test_first_frame(event, holds_fence, actions, state):
    machine = channel()
    assert machine.receive_frame(event, holds_fence=holds_fence) == actions
    assert machine.state is state


def test_a_first_bootstrap_without_session_control_may_only_attach():
    # The binding decides (an identical body still attaches); the machine says it may not bind.
    machine = channel(scopes=("files:read",))
    assert machine.receive_frame(BOOTSTRAP, holds_fence=True) == [Bind(BootstrapBody.model_validate(BODY), may_bind=False)]


def test_a_mismatched_first_bootstrap_is_refused_before_the_fence_is_asked():
    # Order of the checks: a mismatch is reported as a mismatch even when the socket is
    # also fenced out (the peer's error is the more useful one).
    machine = channel()
    mismatch = frame("session.bootstrap", {**BODY, "sessionId": "other"})
    assert machine.receive_frame(mismatch, holds_fence=False) == close(1008, closes.BOOTSTRAP_MISMATCH_REASON)


def error(code: str, message: str, call_id: str | None = None) -> list:
    from sandbox_supervisor.daemon.session.control import error_reply

    return [error_reply(code, message, call_id)]


# --- binding -------------------------------------------------------------------------------

BODY_MODEL = BootstrapBody.model_validate(BODY)
BINDING = [
    (Bound(BODY_MODEL, True, 1.25), [SendReadiness(BODY_MODEL, True, 1.25)], ChannelState.ATTACHED),
    (Bound(BODY_MODEL, False, 0.5), [SendReadiness(BODY_MODEL, False, 0.5)], ChannelState.ATTACHED),
    (BindRefused(errors.CWD_INVALID, "no"), [Reject(errors.CWD_INVALID, "no")], ChannelState.REJECTING),
    (BindFailed(), close(1011, closes.INTERNAL_REASON), ChannelState.CLOSED),
    # A first bootstrap that would bind without session:control: refused, closed, nothing terminates.
    (BindNotAllowed(), [*error(errors.FORBIDDEN, "Binding or rebinding the session needs the session:control scope; nothing changed."),
                        *close(1008, closes.BIND_FORBIDDEN_REASON)], ChannelState.CLOSED),
]


@pytest.mark.parametrize("outcome, actions, state", BINDING)
def test_binding_outcome(outcome, actions, state):
    machine = channel(ChannelState.BINDING)
    assert machine.binding_decided(outcome) == actions
    assert machine.state is state


def test_a_refused_rebinding_leaves_the_socket_attached():
    machine = channel(ChannelState.ATTACHED, scopes=("files:read",))
    assert machine.receive_frame(BOOTSTRAP, holds_fence=True) == [Bind(BODY_MODEL, may_bind=False)]
    assert machine.binding_decided(BindNotAllowed()) == error(
        errors.FORBIDDEN, "Binding or rebinding the session needs the session:control scope; nothing changed."
    )
    assert machine.state is ChannelState.ATTACHED


def test_a_binding_outcome_after_a_close_request_does_nothing():
    machine = channel(ChannelState.BINDING)
    machine.close_requested()
    assert machine.binding_decided(Bound(BODY_MODEL, True, 1.25)) == []
    assert machine.state is ChannelState.CLOSED


def test_a_binding_outcome_outside_binding_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        channel(ChannelState.ATTACHED).binding_decided(Bound(BODY_MODEL, True, 1.25))


def test_readiness_that_cannot_be_sent_closes_1011():
    machine = channel(ChannelState.ATTACHED)
    assert machine.readiness_failed() == close(1011, closes.SEND_FAILED_REASON)


@pytest.mark.parametrize("state", [ChannelState.BINDING, ChannelState.ATTACHED])
def test_state_that_cannot_be_read_for_an_answer_closes_1011(state):
    machine = channel(state)
    assert machine.state_unavailable() == close(1011, closes.INTERNAL_REASON)
    assert machine.state is ChannelState.CLOSED


# --- attached --------------------------------------------------------------------------------


ATTACHED = [
    # (frame, holds_fence, scopes, actions, next state)
    (TOOL_CALL, True, None, [SubmitCall(TOOL_CALL.body, GENERATION)], ChannelState.ATTACHED),
    (ACK, True, None, [Acknowledge(3)], ChannelState.ATTACHED),
    (SIGNAL, True, None, [RunExec(SIGNAL)], ChannelState.ATTACHED),
    (READ_OUTPUT, True, None, [RunExec(READ_OUTPUT)], ChannelState.ATTACHED),
    (SIGNAL, True, ("files:read",), error(errors.FORBIDDEN, "The connection lacks the shell:exec scope.", CALL_ID), ChannelState.ATTACHED),
    (READ_OUTPUT, True, ("files:read",), error(errors.FORBIDDEN, "The connection lacks the shell:exec scope.", CALL_ID), ChannelState.ATTACHED),
    (BOOTSTRAP, True, None, [Bind(BODY_MODEL, may_bind=True)], ChannelState.BINDING),
    (BOOTSTRAP, True, ("files:read",), [Bind(BODY_MODEL, may_bind=False)], ChannelState.BINDING),
    # Pruning needs the session's authority (§9): refused, the floor stays.
    (ACK, True, ("files:read", "shell:exec"),
     error(errors.FORBIDDEN, "events.ack needs the session:control scope; the ack floor did not move."), ChannelState.ATTACHED),
    (frame("session.bootstrap", {**BODY, "sessionId": "other"}), True, None,
     error(errors.INVALID_FRAME, "Bootstrap sessionId does not match the session."), ChannelState.ATTACHED),
    (BAD, True, None, error(errors.INVALID_FRAME, "Frame is not valid JSON."), ChannelState.ATTACHED),
    (UNKNOWN, True, None, error(errors.UNKNOWN_KIND, "Frame kind is not known.", CALL_ID), ChannelState.ATTACHED),
    # Fenced out, or another generation: nothing acts, whatever the frame.
    (TOOL_CALL, False, None, error(errors.GENERATION_MISMATCH, "The frame's connectionGeneration is not the fenced generation."), ChannelState.ATTACHED),
    (ACK, False, None, error(errors.GENERATION_MISMATCH, "The frame's connectionGeneration is not the fenced generation."), ChannelState.ATTACHED),
    (BOOTSTRAP, False, None, error(errors.GENERATION_MISMATCH, "The frame's connectionGeneration is not the fenced generation."), ChannelState.ATTACHED),
    (frame("events.ack", {"seq": 1}, generation=GENERATION - 1), True, None,
     error(errors.GENERATION_MISMATCH, "The frame's connectionGeneration is not the fenced generation."), ChannelState.ATTACHED),
]


@pytest.mark.parametrize("event, holds_fence, scopes, actions, state", ATTACHED)
def test_attached_frame(event, holds_fence, scopes, actions, state):
    machine = channel(ChannelState.ATTACHED, **({"scopes": scopes} if scopes else {}))
    assert machine.receive_frame(event, holds_fence=holds_fence) == actions
    assert machine.state is state


def test_may_act_needs_attached_the_own_generation_and_the_fence():
    machine = channel(ChannelState.ATTACHED)
    assert machine.may_act(GENERATION, holds_fence=True)
    assert not machine.may_act(GENERATION, holds_fence=False)
    assert not machine.may_act(GENERATION + 1, holds_fence=True)
    machine.close_requested()  # superseded or stopping: a call that waited for a slot must not run
    assert not machine.may_act(GENERATION, holds_fence=True)
    assert not channel(ChannelState.AWAITING_BOOTSTRAP).may_act(GENERATION, holds_fence=True)


# --- rejecting, closing, socket events ---------------------------------------------------------


@pytest.mark.parametrize("state", [ChannelState.REJECTING, ChannelState.CLOSED])
@pytest.mark.parametrize("event", [BOOTSTRAP, TOOL_CALL, ACK, BAD])
def test_frames_do_nothing_while_rejecting_or_closed(state, event):
    machine = channel(state)
    assert machine.receive_frame(event, holds_fence=True) == []
    assert machine.state is state


def test_a_frame_while_binding_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        channel(ChannelState.BINDING).receive_frame(ACK, holds_fence=True)


REJECTION = [
    # (sent, peer_closed, actions)
    (False, False, close(1011, closes.SEND_FAILED_REASON)),
    (True, True, []),  # the client closed (with its receipt or not): nothing left to send
    (True, False, close(1011, closes.RECEIPT_NOT_OBSERVED_REASON)),
]


@pytest.mark.parametrize("sent, peer_closed, actions", REJECTION)
def test_rejection_end(sent, peer_closed, actions):
    machine = channel(ChannelState.REJECTING)
    assert machine.rejection_finished(rejection_sent=sent, peer_closed=peer_closed) == actions
    assert machine.state is ChannelState.CLOSED


SOCKET_EVENTS = [
    ("receive_binary", close(1003, closes.BINARY_REASON)),
    ("receive_oversized", close(1009, closes.TOO_BIG_REASON)),
    ("idle", close(1011, closes.IDLE_REASON)),
]


@pytest.mark.parametrize("state", [ChannelState.AWAITING_BOOTSTRAP, ChannelState.ATTACHED])
@pytest.mark.parametrize("event, actions", SOCKET_EVENTS)
def test_socket_events_close(state, event, actions):
    machine = channel(state)
    assert getattr(machine, event)() == actions
    assert machine.state is ChannelState.CLOSED
    assert getattr(machine, event)() == []  # the first close wins


def test_every_close_the_machine_sends_is_in_the_protocol_table():
    sent = {(c.code, c.reason) for c in closes.CLOSES if c.sender == "supervisor"}
    produced = set()
    for event, holds_fence, actions, _ in FIRST_FRAME:
        produced |= {(a.code, a.reason) for a in actions if isinstance(a, Close)}
    for _, actions, _ in BINDING + [(None, a, None) for _, _, a in REJECTION] + [(None, a, None) for _, a in SOCKET_EVENTS]:
        produced |= {(a.code, a.reason) for a in actions if isinstance(a, Close)}
    produced.add((closes.CLOSE_INTERNAL_ERROR, closes.SEND_FAILED_REASON))
    assert produced <= sent
