"""Stable error codes of the protocol: one name per code, so no string literal is repeated.

Three families share this module because a peer sees all of them in the same `code` /
`error` fields: frame and tool-result codes (PROTOCOL.md 6.2, 7), the upgrade gate's HTTP
codes (section 2 and the routes of section 1), and bootstrap rejection codes (6.1).
"""

from __future__ import annotations

# --- `error` frames and `tool.result` errors (sections 6.2 and 7) ---
INVALID_FRAME = "invalid_frame"
UNKNOWN_KIND = "unknown_kind"
FORBIDDEN = "forbidden"
GENERATION_MISMATCH = "generation_mismatch"
ACK_AHEAD = "ack_ahead"
UNKNOWN_CALL = "unknown_call"
NOT_RUNNING = "not_running"
INVALID_PARAMETERS = "invalid_parameters"
PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
NOT_FOUND = "not_found"
BASE_SHA_MISMATCH = "base_sha_mismatch"
PATCH_DOES_NOT_APPLY = "patch_does_not_apply"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
TOO_MANY_PROCESSES = "too_many_processes"
INTERRUPTED = "interrupted"
INTERNAL = "internal"

# --- HTTP answers of the front and the upgrade gate (sections 1 and 2) ---
DRAINING = "draining"
TERMINATED = "terminated"
INVALID_ROUTING_HEADERS = "invalid_routing_headers"
SANDBOX_IDENTITY_UNAVAILABLE = "sandbox_identity_unavailable"
SANDBOX_MISMATCH = "sandbox_mismatch"
INVALID_AUTHORITY = "invalid_authority"
SESSION_MISMATCH = "session_mismatch"
ACK_FLOOR_AHEAD = "ack_floor_ahead"
STALE_GENERATION = "stale_generation"
STATE_UNAVAILABLE = "state_unavailable"
UPGRADE_REQUIRED = "upgrade_required"
# Same text as NOT_FOUND, but a different meaning (an HTTP route, not a file); two names keep
# the call sites honest about which one they mean.
NOT_FOUND_ROUTE = "not_found"
TOO_MANY_HANDSHAKES = "too_many_handshakes"
REQUEST_HEAD_TOO_LARGE = "request_head_too_large"
BAD_REQUEST = "bad_request"

# --- `session.bootstrap.rejected` codes (section 6.1) ---
BOOTSTRAP_MISMATCH = "session_binding_mismatch"
CWD_INVALID = "cwd_not_in_workspace"
REPOSITORY_MISSING = "repository_root_missing"
PROFILE_NOT_ALLOWED = "profile_not_allowed"

# Every HTTP refusal: code -> (status, the one sentence the peer gets). The peer learns the
# category; the daemon's log keeps the detail.
HTTP_ERRORS: dict[str, tuple[int, str]] = {
    BAD_REQUEST: (400, "The request is not valid HTTP/1.1."),
    NOT_FOUND_ROUTE: (404, "No such route."),
    UPGRADE_REQUIRED: (426, "This route takes a WebSocket upgrade."),
    REQUEST_HEAD_TOO_LARGE: (431, "The request head is too large."),
    TOO_MANY_HANDSHAKES: (503, "Too many handshakes in progress; retry shortly."),
    # The upgrade gate's checks, in their order (section 2).
    DRAINING: (503, "The supervisor is stopping."),
    TERMINATED: (503, "The supervisor has terminated after a bootstrap rejection."),
    INVALID_ROUTING_HEADERS: (400, "A routing header is missing or malformed."),
    SANDBOX_IDENTITY_UNAVAILABLE: (503, "The sandbox identity cannot be read."),
    SANDBOX_MISMATCH: (409, "The request is for another sandbox."),
    INVALID_AUTHORITY: (401, "The control-authority assertion is missing or invalid."),
    SESSION_MISMATCH: (409, "The supervisor is bound to another session."),
    ACK_FLOOR_AHEAD: (409, "The event ack floor is ahead of the supervisor's journal."),
    STALE_GENERATION: (409, "The connection generation is stale."),
    STATE_UNAVAILABLE: (500, "The supervisor could not record the connection."),
}
# The codes a `tool.result` with ok:false may carry (section 7).
TOOL_ERROR_CODES = frozenset(
    {
        INVALID_PARAMETERS,
        FORBIDDEN,
        PATH_OUTSIDE_WORKSPACE,
        NOT_FOUND,
        BASE_SHA_MISMATCH,
        PATCH_DOES_NOT_APPLY,
        IDEMPOTENCY_KEY_REUSED,
        TOO_MANY_PROCESSES,
        INTERRUPTED,
        INTERNAL,
    }
)
