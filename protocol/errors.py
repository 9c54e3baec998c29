"""Stable error codes of the protocol: one name per code, so no string literal is repeated.

Three families share this module because a peer sees all of them in the same `code` /
`error` fields: frame and tool-result codes (docs/protocol.md §6.5, §7.6), the HTTP codes of
the routes and the upgrade gate (§1, §2), and bootstrap rejection codes (§5.4). Each family
also has a one-line meaning per code: docs/codes.md is generated from them
(`python -m sandbox_supervisor.protocol.codes_doc`).
"""

from __future__ import annotations

# --- `error` frames and `tool.result` errors (docs/protocol.md §6.5, §7.6) ---
INVALID_FRAME = "invalid_frame"
UNKNOWN_KIND = "unknown_kind"
FORBIDDEN = "forbidden"
GENERATION_MISMATCH = "generation_mismatch"
ACK_AHEAD = "ack_ahead"
# A tool.call refused because the journal holds more unacknowledged bytes than the cap
# (journal.max_unacked_bytes, docs/protocol.md §9): nothing was recorded, the key is free.
JOURNAL_FULL = "journal_full"
UNKNOWN_CALL = "unknown_call"
NOT_RUNNING = "not_running"
NOT_A_TERMINAL = "not_a_terminal"
INVALID_PARAMETERS = "invalid_parameters"
PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
NOT_FOUND = "not_found"
BASE_SHA_MISMATCH = "base_sha_mismatch"
PATCH_DOES_NOT_APPLY = "patch_does_not_apply"
FILE_TOO_LARGE = "file_too_large"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
TOO_MANY_PROCESSES = "too_many_processes"
RESOURCE_EXHAUSTED = "resource_exhausted"
# A call cut by a stop or a crash (resolved at the next start) or whose command host died:
# the call is complete, its key answers this result for ever. The seed's name.
INTERRUPTED = "interrupted"
# A command or process refused because the supervisor's stop has begun: nothing started, the
# key is free. Not `interrupted`: that one completes the key, and a client must tell them apart.
SUPERVISOR_STOPPING = "supervisor_stopping"
INTERNAL = "internal"

# --- HTTP answers of the front and the upgrade gate (docs/protocol.md §1, §2) ---
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
STORAGE_FULL = "storage_full"
UPGRADE_REQUIRED = "upgrade_required"
# Same text as NOT_FOUND, but a different meaning (an HTTP route, not a file); two names keep
# the call sites honest about which one they mean.
NOT_FOUND_ROUTE = "not_found"
TOO_MANY_HANDSHAKES = "too_many_handshakes"
REQUEST_HEAD_TOO_LARGE = "request_head_too_large"
BAD_REQUEST = "bad_request"

# --- `session.bootstrap.rejected` codes (docs/protocol.md §5.4) ---
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
    # The upgrade gate's checks, in their order (docs/protocol.md §2.2).
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
    STORAGE_FULL: (503, "The supervisor's state directory is full; retry later."),
}
# Seconds a `storage_full` refusal asks the client to wait (its Retry-After header): the
# supervisor retries its own writes every second, so a few seconds is when a freed disk is
# in use again, without a control plane hammering a disk that stays full.
STORAGE_FULL_RETRY_AFTER_S = 5
# The codes a `tool.result` with ok:false may carry (docs/protocol.md §7.6).
TOOL_ERROR_CODES = frozenset(
    {
        INVALID_PARAMETERS,
        FORBIDDEN,
        PATH_OUTSIDE_WORKSPACE,
        NOT_FOUND,
        BASE_SHA_MISMATCH,
        PATCH_DOES_NOT_APPLY,
        FILE_TOO_LARGE,
        IDEMPOTENCY_KEY_REUSED,
        TOO_MANY_PROCESSES,
        RESOURCE_EXHAUSTED,
        SUPERVISOR_STOPPING,
        INTERRUPTED,
        INTERNAL,
    }
)
# The codes of `session.bootstrap.rejected` (docs/protocol.md §5.4). Every one is terminal.
BOOTSTRAP_REJECTION_CODES = frozenset(
    {BOOTSTRAP_MISMATCH, CWD_INVALID, REPOSITORY_MISSING, PROFILE_NOT_ALLOWED}
)

# --- what each code means, one line each (docs/codes.md is rendered from these) ---
# Kept per family, because one text ("not_found") is both an HTTP route code and a tool code,
# with two meanings. The order of each table is the order of docs/codes.md.

HTTP_ERROR_MEANINGS: dict[str, str] = {
    BAD_REQUEST: (
        "The bytes are not an HTTP/1.x request head (an HTTP/1.1 request without Host included), "
        "or an upgrade of the control path carries a body (Transfer-Encoding, or a Content-Length "
        "other than 0) or has a line ending in a bare LF."
    ),
    NOT_FOUND_ROUTE: (
        "No such route: another path or method, HEAD, the health path with an Upgrade: websocket "
        "token, or the metrics path while metrics are disabled."
    ),
    UPGRADE_REQUIRED: (
        "The control path without a well-formed WebSocket handshake; sent with the headers "
        "upgrade: websocket and sec-websocket-version: 13."
    ),
    REQUEST_HEAD_TOO_LARGE: "The request head is over 16,384 bytes, the terminating blank line included.",
    TOO_MANY_HANDSHAKES: (
        "The listener's pre-authentication budget is spent: its handshake pool is full "
        "(websocket.max_handshakes for TCP, max_unix_handshakes for unix), the source address "
        "holds websocket.max_handshakes_per_peer, or the connection fell to early drop while "
        "the pool filled (§1.3); retry shortly."
    ),
    DRAINING: "Gate step 1: the supervisor is stopping.",
    TERMINATED: "Gate step 1: a bootstrap was rejected; the supervisor exits 78 and never serves again.",
    INVALID_ROUTING_HEADERS: (
        "Gate step 2: a routing header other than the assertion is missing, malformed or "
        "duplicated, or the assertion header is duplicated."
    ),
    SANDBOX_IDENTITY_UNAVAILABLE: (
        "Gate step 3: the local sandbox id cannot be read or is not a valid id; it is read "
        "again at the next upgrade."
    ),
    SANDBOX_MISMATCH: "Gate step 4: e2b-sandbox-id is not this sandbox's id.",
    INVALID_AUTHORITY: (
        'Gate step 5: the assertion is missing or invalid, or its jti was already used; sent '
        'with WWW-Authenticate: Bearer error="invalid_token".'
    ),
    SESSION_MISMATCH: "Gate step 6: the supervisor is bound to another session id.",
    ACK_FLOOR_AHEAD: "Gate step 7: x-coding-agent-event-ack is above the highest journaled seq.",
    STALE_GENERATION: (
        "Gate step 8: the generation does not pass the fence (lower, or equal with another "
        "attempt id)."
    ),
    STATE_UNAVAILABLE: (
        "The state database could not be read for the gate's checks, or the admission could "
        "not be recorded."
    ),
    STORAGE_FULL: (
        "The admission could not be recorded because the state directory's file system is "
        "full, or the supervisor started on a full disk and waits for space to open its state; "
        "nothing was recorded. Sent with Retry-After (seconds); the same upgrade (a new "
        "attempt and assertion) succeeds once space is freed, without a restart."
    ),
}

# The codes an `error` frame may carry (docs/protocol.md §6.5; not journaled, the socket stays
# open), with their meanings.
FRAME_ERROR_MEANINGS: dict[str, str] = {
    INVALID_FRAME: (
        "The frame is not JSON, not an object, has no string kind, or does not match its "
        "kind's schema; a tool.call without a readable call_id; a repeated session.bootstrap "
        "with another sessionId."
    ),
    UNKNOWN_KIND: "The frame's kind is not a client kind (server kinds included).",
    GENERATION_MISMATCH: (
        "The frame did nothing: its socket is not the authoritative one, or its "
        "connectionGeneration is not the fenced generation."
    ),
    ACK_AHEAD: "events.ack above the highest journaled seq; the floor is unchanged.",
    JOURNAL_FULL: (
        "A tool.call while the journal's unacknowledged events exceed journal.max_unacked_bytes "
        "(the client does not ack what it receives): nothing was recorded or run, the key is "
        "free; ack the events received, then send the call again."
    ),
    FORBIDDEN: (
        "exec.* frames on a connection without the shell:exec scope; "
        "events.ack, or a session.bootstrap that would bind or rebind the session, on a "
        "connection without the session:control scope (nothing changed)."
    ),
    UNKNOWN_CALL: (
        "An exec.* frame for a call_id without a spool directory (no command or process was "
        "attempted under it, or its spool was pruned), or for a command or process whose "
        "events the socket may not see (its allowed_commands)."
    ),
    NOT_RUNNING: (
        "exec.signal for a command whose shell has exited, that ran under an earlier daemon "
        "process, or that failed to start; exec.signal, exec.write_stdin, exec.close_stdin or "
        "exec.resize for a process that has ended, or exec.write_stdin/exec.close_stdin/"
        "exec.resize for an execute_shell_command command (its stdin is /dev/null)."
    ),
    NOT_A_TERMINAL: "exec.resize for a process started without a pty.",
    INTERNAL: (
        "The state database refused to record a call (nothing ran) or its result (the message "
        "says whether to retry with the same key)."
    ),
}

TOOL_ERROR_MEANINGS: dict[str, str] = {
    INVALID_PARAMETERS: (
        "The call does not match its tool's schema or names no tool; a directory, special "
        "file or unresolvable path; a text that is not a unified diff of one file; a shell "
        "cwd that is not a directory; a call_id already used for a command."
    ),
    FORBIDDEN: (
        "The connection lacks the tool's scope, or the allowed_commands guard refused the "
        "command line or an environment variable (the error then has command, and variable "
        "for an environment variable), or a retried key's command ran under other "
        "allowed_commands (nothing replayed)."
    ),
    PATH_OUTSIDE_WORKSPACE: (
        "The path, or the shell's cwd, resolves outside agent.cwd or outside the assertion's "
        "allowed_paths; or a retried key's recorded result lies outside them (nothing replayed)."
    ),
    NOT_FOUND: (
        "read_file: no such file, or a parent is not a directory; any tool: agent.cwd no "
        "longer exists."
    ),
    BASE_SHA_MISMATCH: (
        "base_sha is not the git blob sha of the file's current content (the error has "
        "current_sha); nothing was written."
    ),
    PATCH_DOES_NOT_APPLY: "The diff does not fit the file (the error has hunk or reason); nothing was written.",
    FILE_TOO_LARGE: (
        "read_file or apply_file_patch: the file (or, for a patch, its result) is larger than "
        "files.max_file_bytes (the error has size and max_bytes); nothing was read or written."
    ),
    IDEMPOTENCY_KEY_REUSED: "The key was used before with other parameters or another tool; nothing ran.",
    TOO_MANY_PROCESSES: (
        "exec.max_processes commands are running or being spawned; nothing ran, and the key "
        "is free again."
    ),
    RESOURCE_EXHAUSTED: (
        "The machine was short of something for a moment: a command could not be started "
        "(EMFILE, ENFILE, EAGAIN, ENOMEM, ENOSPC, EDQUOT), or a file tool could not open, read "
        "or write (EMFILE, ENFILE, ENOMEM, ENOSPC, EDQUOT); nothing ran or was written, and "
        "the key is free again: retry later."
    ),
    SUPERVISOR_STOPPING: (
        "execute_shell_command or start_process once the supervisor's stop has begun: nothing "
        "started, and the key is free again; send the call again to the next supervisor."
    ),
    INTERRUPTED: (
        "A stop or a crash cut the call and the next start resolved it, or the command host "
        "died while the command ran: the call is complete (never re-run) and its key answers "
        "this result; a command's exec.completed then has interrupted: true."
    ),
    INTERNAL: (
        "The file system refused a read or a write, or a command could not be started, for "
        "a reason other than a shortage (resource_exhausted); a file kept changing during "
        "read_file or apply_file_patch; or a bug (logged)."
    ),
}

BOOTSTRAP_REJECTION_MEANINGS: dict[str, str] = {
    BOOTSTRAP_MISMATCH: "The supervisor is bound, and this bootstrap's digest differs from the bound one.",
    CWD_INVALID: (
        "agent.cwd is not an existing directory inside paths.workspace_root, as text and "
        "after symlinks are resolved."
    ),
    REPOSITORY_MISSING: "A repositories[].root is not an existing directory.",
    PROFILE_NOT_ALLOWED: "agent.profile is not in bootstrap.profiles (an empty list allows any).",
}

# The HTTP answers that carry no `error` code, so that docs/codes.md lists every status a
# peer can get: (status, what it means).
HTTP_OTHER_ANSWERS: tuple[tuple[int, str], ...] = (
    (101, "Switching Protocols on the control path: the upgrade passed the gate and was recorded."),
    (200, 'The health path while serving ({"status":"ok",…}); the metrics path when enabled (Prometheus text).'),
    (503, 'The health path while stopping ({"status":"draining",…}) or after a termination ({"status":"terminated",…}).'),
)
