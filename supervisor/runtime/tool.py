"""What a tool is to the daemon, and what a running call carries (docs/protocol.md §7).

A tool has two halves. Its wire declaration (name, scope, call, parameter and result models:
`protocol.tools.TOOL_SPECS`) lives in the protocol, which clients and the JSON Schemas are
generated from without the daemon. Its runtime half is one module under `runtime/tools/`: how
it runs, and how a call it left pending is completed after a crash; `runtime/registry.py`
lists the modules. This module is the interface between them and the call runner, so neither
imports the other.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.tools import ToolCall, ToolSpec
from sandbox_supervisor.daemon.runtime.files import DEFAULT_MAX_FILE_BYTES
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots
from sandbox_supervisor.daemon.state.keys import CallKey, key_space
from sandbox_supervisor.daemon.state.store import CallRecord, StateStore
from sandbox_supervisor.daemon.state.visibility import Audience

# Sends one encoded, non-journaled frame to the socket that sent a call.
SendReply = Callable[[str], Awaitable[None]]
Event = tuple[str, dict[str, Any]]  # (kind, body) of an event to journal


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a call may touch, captured when it is accepted and kept for its whole run (a
    later connection's claims never widen or narrow a call already running)."""

    session_id: str
    generation: int
    cwd: str
    agent_env: dict[str, str]
    scopes: frozenset[str]
    allowed_paths: tuple[str, ...] | None
    allowed_commands: tuple[str, ...] | None
    # What the sending socket may see (docs/protocol.md §9.1): an idempotency replay of
    # another socket's result outside it is refused. None: everything.
    audience: Audience | None = None
    # Whose idempotency keys its calls claim (state/keys.py): the owner's, or a delegated
    # assertion's own space. Derived from the bounds above, never passed, so no caller can
    # put a delegated socket's calls in the owner's space.
    key_space: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_space", key_space(self.scopes, self.allowed_paths, self.allowed_commands))


@dataclass(slots=True)
class RunningCall:
    call: ToolCall
    context: CallContext
    # Events a tool wants journaled in the same transaction as its tool.result (a shell
    # command's last output and its exec.completed), so a crash cannot split them.
    final_events: list[Event] = field(default_factory=list)
    # The socket that sent the call, for a best-effort answer when its result cannot be
    # journaled (the journal is how results normally travel).
    reply: SendReply | None = None
    # The real path a file tool resolved, set as soon as it is known: who may see the
    # call's result depends on it (docs/protocol.md §9.1).
    view_path: str | None = None
    # The tool refused the call in a way that frees its key (ToolFailure.frees_key).
    frees_key: bool = False

    @property
    def key(self) -> CallKey | None:
        """The call's idempotency key as stored: in its socket's key space."""
        key = self.call.idempotency_key
        return None if key is None else CallKey(self.context.key_space, key)


class CommandService(Protocol):
    """The shell runtime as the execute_shell_command tool uses it."""

    async def execute(self, running: RunningCall) -> dict[str, Any]: ...


class ProcessService(Protocol):
    """The process host as the start_process tool uses it."""

    async def start(self, running: RunningCall) -> dict[str, Any]: ...


# Worker threads each kind of file work may hold at once. Separate limiters, not trio's
# default one (shared by every to_thread call): slow reads can fill theirs, but never take
# the thread a patch (or the state store) needs. Patches are serialised by file_write_lock
# anyway, so one thread is all they can use.
READ_THREADS = 4
PATCH_THREADS = 1


@dataclass(frozen=True, slots=True)
class ToolServices:
    """What tools run with, built once by the app."""

    store: StateStore
    # Patches are planned against a base sha and then written; two different keys patching
    # the same file at once must not both pass the check against one base.
    file_write_lock: trio.Lock
    shell: CommandService
    # `[files] max_file_bytes`: read_file and apply_file_patch refuse larger files.
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # (uid, gid) of the command user under privilege separation: files and directories
    # apply_file_patch creates are given to it (patch.commit_patch); None: the daemon's own.
    file_owner: tuple[int, int] | None = None
    read_limiter: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(READ_THREADS)
    )
    patch_limiter: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(PATCH_THREADS)
    )
    # agent.cwd opened once (at bootstrap, or at a bound restart): the file tools resolve
    # from that descriptor, never from the path again (paths.py).
    roots: WorkspaceRoots = field(default_factory=WorkspaceRoots)
    # Processes kept by holders (start_process); None where a test wires no host.
    processes: ProcessService | None = None


@dataclass(frozen=True, slots=True)
class RecoveryEnv:
    """What crash recovery has: it runs at start, before any nursery or socket."""

    store: StateStore
    state_dir: Path
    # Recovery re-plans and re-hashes patched files: bounded like a live patch.
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # (uid, gid) given to what a recovered patch creates, as a live patch does ([exec] user).
    file_owner: tuple[int, int] | None = None
    # The daemon's opened agent.cwd (paths.WorkspaceRoots), shared with the live tools.
    roots: WorkspaceRoots = field(default_factory=WorkspaceRoots)
    # When recovery began: a temp file older than this is a killed daemon's leftover, never
    # one of this daemon's writes.
    started_at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Recovered:
    """A pending call's completion: events to journal first, then its tool.result body."""

    body: dict[str, Any]
    preceding: list[Event] = field(default_factory=list)
    # The real path a file tool's recovery resolved (docs/protocol.md §9.1), as RunningCall's.
    view_path: str | None = None


Run = Callable[[RunningCall], Awaitable[dict[str, Any]]]
# A tool's synchronous fast path: the result at once, or None when the call needs the full
# (awaiting) run. It must not block for long: it runs in the socket's reader task.
RunNow = Callable[[RunningCall], "dict[str, Any] | None"]
Recover = Callable[[CallRecord, RecoveryEnv], Recovered]


class ToolModule(Protocol):
    """What each module under runtime/tools/ declares (read-only: a module is the value)."""

    @property
    def NAME(self) -> str: ...

    @property
    def recover(self) -> Recover | None: ...

    def bind(self, services: ToolServices) -> Tool: ...


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool as the runtime runs it: the protocol's declaration (name, scope, models) bound
    to how it runs."""

    spec: ToolSpec
    run: Run
    run_now: RunNow | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def scope(self) -> str:
        return self.spec.scope


def result_body(
    call_id: str,
    idempotency_key: str | None,
    tool_name: str | None,
    *,
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A tool.result body: ok with `result`, or not with `error`."""
    body: dict[str, Any] = {
        "call_id": call_id,
        "idempotency_key": idempotency_key,
        "tool_name": tool_name,
        "ok": error is None,
    }
    if error is None:
        body["result"] = result
    else:
        body["error"] = error
    return body


def interrupted(message: str, **details: Any) -> dict[str, Any]:
    """The error of a call a crash cut short (docs/protocol.md §10.2)."""
    return {"code": errors.INTERRUPTED, "message": message, **details}
