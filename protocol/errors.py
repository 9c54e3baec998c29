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

# --- `session.bootstrap.rejected` codes (section 6.1) ---
BOOTSTRAP_MISMATCH = "session_binding_mismatch"
CWD_INVALID = "cwd_not_in_workspace"
REPOSITORY_MISSING = "repository_root_missing"
PROFILE_NOT_ALLOWED = "profile_not_allowed"

# The codes `decode_client_frame` can produce (FrameError.code).
FRAME_ERROR_CODES = frozenset({INVALID_FRAME, UNKNOWN_KIND})
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
