"""The one typed error the file tools raise (docs/protocol.md §7.6: `tool.result` ok:false).

The call runner journals a `ToolFailure` as `to_error()`; anything else that escapes a tool is
a bug, logged with its traceback (`tool.crashed`) and answered `internal`. Subclasses (`PatchError`, `PathOutsideWorkspace`) only
name where a failure comes from; the wire sees `code`, `message` and the details.
"""

from __future__ import annotations

import errno
from typing import Any

from sandbox_supervisor.protocol.errors import INTERNAL, INVALID_PARAMETERS, RESOURCE_EXHAUSTED, TOOL_ERROR_CODES

# Keys of the error object that details may not overwrite.
_RESERVED_KEYS = frozenset({"code", "message"})


class ToolFailure(Exception):
    """A failure the caller caused or can act on, with a stable protocol `code`.

    `details` are the code's own fields (`current_sha` for base_sha_mismatch, `hunk` for
    patch_does_not_apply); they sit next to code and message in the error object, as the
    open `ToolError` model expects.
    """

    def __init__(
        self, code: str, message: str, details: dict[str, Any] | None = None, *, frees_key: bool = False
    ) -> None:
        if code not in TOOL_ERROR_CODES:
            # A typo here would reach the peer as a code the protocol does not define.
            raise ValueError(f"not a tool error code: {code!r}")
        details = dict(details or {})
        if _RESERVED_KEYS & details.keys():
            raise ValueError("details may not carry 'code' or 'message'")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details
        # Refused before anything happened, for a reason tied to this attempt rather than to
        # the call (a call_id already taken): the key is freed with the result, so this
        # refusal never decides what a retry with a fresh call_id does (docs/protocol.md §8).
        self.frees_key = frees_key

    def to_error(self) -> dict[str, Any]:
        """The `error` object of the `tool.result` (validates as protocol.frames.ToolError)."""
        return {"code": self.code, "message": self.message, **self.details}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, {self.details!r})"


# Errors of a file tool's open, read or write that come from the machine's state at that
# moment, not from the call: no descriptor left (EMFILE ours, ENFILE the system's), no
# kernel memory, no space or quota left. The same call succeeds once the shortage passes.
FILE_EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT})
# The same for starting a command, plus EAGAIN: fork(2) gives it at the process limit
# (RLIMIT_NPROC, a pids cgroup), which ends as the other processes do.
SPAWN_EXHAUSTION_ERRNOS = FILE_EXHAUSTION_ERRNOS | {errno.EAGAIN}


def resource_failure(message: str) -> ToolFailure:
    """`resource_exhausted` for a shortage (docs/protocol.md §7.6). It frees the key: the
    failure says nothing about the call, so a retry once the shortage has passed must run it
    rather than replay the failure (calls.TRANSIENT_REFUSALS)."""
    return ToolFailure(RESOURCE_EXHAUSTED, message, frees_key=True)


def os_failure(exc: OSError, action: str) -> ToolFailure:
    """A typed answer for an OSError the file system gave a file tool (`action`: "read",
    "written"), instead of a crash logged with a traceback: a name longer than the file
    system allows is the caller's `invalid_parameters`; a shortage (a full disk, no
    descriptor left) is `resource_exhausted`; anything else (permission denied, an I/O
    error) is `internal` with the system's own words."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno == errno.ENAMETOOLONG:
        return ToolFailure(INVALID_PARAMETERS, f"The path could not be {action}: {reason}.")
    if exc.errno in FILE_EXHAUSTION_ERRNOS:
        return resource_failure(f"The file could not be {action}: {reason}; retry later.")
    return ToolFailure(INTERNAL, f"The file could not be {action}: {reason}.")
