"""WebSocket close codes and reasons of the control channel: one definition for the daemon,
the reference client and the docs (docs/codes.md is generated from `CLOSES`; the rules are
in docs/protocol.md §4.4)."""

from __future__ import annotations

from dataclasses import dataclass

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
# Sent by the client, not the daemon: "I have read session.bootstrap.rejected".
CLOSE_REJECTION_RECEIPT = 4400

SUPERSEDED_REASON = "Connection attempt was superseded."
STOPPING_REASON = "Supervisor listener stopping."
IDLE_REASON = "Connection idle timeout."
BINARY_REASON = "Binary frames are not supported."
EXPECTED_BOOTSTRAP_REASON = "Expected session bootstrap as first frame."
BOOTSTRAP_MISMATCH_REASON = "Bootstrap does not match upgrade headers."
RECEIPT_NOT_OBSERVED_REASON = "Supervisor rejection receipt was not observed."
REJECTION_RECEIPT_REASON = "bootstrap rejection received"
SEND_FAILED_REASON = "Supervisor could not send a frame."
WRITE_TIMEOUT_REASON = "Peer stopped reading."
INTERNAL_REASON = "Supervisor internal error."
TOO_BIG_REASON = "Message is larger than the limit."
BIND_FORBIDDEN_REASON = "Binding the session needs the session:control scope."
# The WebSocket layer's text when a message passes its limit, which it counts in characters
# while the message arrives (trio-websocket's text, kept when the daemon's socket became its
# own). Shown with the default websocket.max_message_bytes; the number is the configured limit.
LIBRARY_TOO_BIG_REASON = "Exceeded maximum message size: 131072 bytes"

MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is ≤ 125 bytes, 2 are the code


def clip_close_reason(reason: str) -> str:
    """Trim to 123 bytes of UTF-8 without splitting a character."""
    encoded = reason.encode("utf-8")
    if len(encoded) <= MAX_CLOSE_REASON_BYTES:
        return reason
    return encoded[:MAX_CLOSE_REASON_BYTES].decode("utf-8", errors="ignore")


@dataclass(frozen=True, slots=True)
class Close:
    """One close the channel uses: who sends it, its code and reason, and when."""

    code: int
    reason: str
    sender: str  # "supervisor" | "client"
    when: str


CLOSES: tuple[Close, ...] = (
    Close(CLOSE_NORMAL, "", "supervisor", "the socket ended without a more specific reason"),
    Close(CLOSE_GOING_AWAY, STOPPING_REASON, "supervisor", "the daemon is stopping (drain)"),
    Close(CLOSE_PROTOCOL_ERROR, EXPECTED_BOOTSTRAP_REASON, "supervisor", "the first frame is not a valid session.bootstrap"),
    Close(CLOSE_UNSUPPORTED_DATA, BINARY_REASON, "supervisor", "a binary message arrived"),
    Close(CLOSE_POLICY_VIOLATION, BOOTSTRAP_MISMATCH_REASON, "supervisor", "the bootstrap's sessionId or generation differs from the upgrade's headers"),
    Close(CLOSE_POLICY_VIOLATION, BIND_FORBIDDEN_REASON, "supervisor", "the first session.bootstrap would bind the session, or differs from its binding, and the assertion lacks session:control (nothing is bound or terminated)"),
    Close(CLOSE_POLICY_VIOLATION, SUPERSEDED_REASON, "supervisor", "a newer upgrade moved the fence or took the session"),
    Close(CLOSE_MESSAGE_TOO_BIG, LIBRARY_TOO_BIG_REASON, "supervisor", "a message of more than websocket.max_message_bytes characters, stopped by the WebSocket layer while it arrives"),
    Close(CLOSE_MESSAGE_TOO_BIG, TOO_BIG_REASON, "supervisor", "a text message of at most websocket.max_message_bytes characters whose UTF-8 is longer than that many bytes"),
    Close(CLOSE_INTERNAL_ERROR, IDLE_REASON, "supervisor", "no inbound traffic (pongs included) for websocket.idle_timeout_s"),
    Close(CLOSE_INTERNAL_ERROR, RECEIPT_NOT_OBSERVED_REASON, "supervisor", "no 4400 receipt after session.bootstrap.rejected"),
    Close(CLOSE_INTERNAL_ERROR, SEND_FAILED_REASON, "supervisor", "a frame the socket needed could not be sent"),
    Close(CLOSE_INTERNAL_ERROR, WRITE_TIMEOUT_REASON, "supervisor", "one frame could not be written for websocket.write_timeout_s: the peer stopped reading (its events stay journaled for the next socket)"),
    Close(CLOSE_INTERNAL_ERROR, INTERNAL_REASON, "supervisor", "the state database failed during the bootstrap, or a bug cost this socket"),
    Close(CLOSE_REJECTION_RECEIPT, REJECTION_RECEIPT_REASON, "client", "the client read session.bootstrap.rejected"),
)
