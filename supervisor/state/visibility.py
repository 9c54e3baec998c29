"""Which socket may see which journaled event (docs/protocol.md §9.1), as pure functions.

An assertion's scopes and `allowed_paths` bound more than the tools a socket may call: they
bound what it receives. Every journaled event is stored with its *view* — the scope a socket
needs to see it and, for a file tool's result, the real path the call touched — and every
socket has an *audience* — its scopes and its allowed paths, resolved once when it attaches.
A sender sends an event whose view the audience does not cover as `event.withheld` (the seq
and nothing else), so a client's seq handling stays the same: every seq arrives once, in
order, and can be acked.

Decisions:
- `exec.*` events and a shell command's `tool.result` need `shell:exec`; they are not bound
  to paths (a command can read anything its user can, so a path says nothing about them).
  They are bound to the `allowed_commands` they ran under (its *origin*: a fingerprint of the
  set, None for no limit): a socket limited to some commands could not have run `cat
  secret`, so it sees only output of commands run under the very same limit; a socket
  without a limit sees every command's.
- A file tool's result needs the tool's scope and, when the socket has `allowed_paths`, that
  the real path the call resolved lies under one of them (whole components). A *failure*
  before any path was resolved (the walk refused it, a loop, agent.cwd gone) tells only what
  its caller sent, so it needs the scope alone: the caller always gets its answer. A success
  whose path is not known (journaled before views existed) is shown only to sockets without
  `allowed_paths`: unknown is treated as outside.
- A result that refused a call before it touched anything carries only what its caller sent
  (`invalid_parameters` from the schema, `forbidden` for a missing scope,
  `idempotency_key_reused`): it is *public*, so the socket that sent the call always sees its
  answer, whatever its scopes. `path_outside_workspace` is public within the tool's scope
  for the same reason: a restricted socket's own refusal names a path outside its view.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_supervisor.protocol.bootstrap import is_within
from sandbox_supervisor.protocol.errors import PATH_OUTSIDE_WORKSPACE
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED, EXEC_OUTPUT, EXEC_STARTED, TOOL_RESULT
from sandbox_supervisor.protocol.tools import TOOL_SCOPES, TOOL_SPECS

__all__ = [
    "PUBLIC",
    "SHELL_VIEW",
    "UNKNOWN_PATH",
    "Audience",
    "EventView",
    "commands_origin",
    "shell_view",
    "default_view",
    "event_view",
    "call_result_view",
    "is_path_bound",
    "result_view",
    "visible",
]

# Stored as an event's path when the result of a file tool touched a path we do not know: no
# real path equals it (real paths are absolute), so no allowed path admits it.
UNKNOWN_PATH = "?"

_PATH_BOUND_TOOLS = frozenset(spec.name for spec in TOOL_SPECS if "path" in spec.parameters.model_fields)
_SHELL_SCOPE = TOOL_SCOPES["execute_shell_command"]


@dataclass(frozen=True, slots=True)
class EventView:
    """Who may see one journaled event: `scope` None is any socket of the session; `path`
    None is not bound to a path, else the absolute real path the call touched; `commands`
    (shell events) the origin of the allowed_commands the command ran under."""

    scope: str | None
    path: str | None
    commands: str | None = None


PUBLIC = EventView(None, None)
SHELL_VIEW = EventView(_SHELL_SCOPE, None)


def commands_origin(allowed_commands: Iterable[str] | None) -> str | None:
    """A fingerprint of an `allowed_commands` set (order and repeats do not matter), None for
    no limit: equal fingerprints, equal limits."""
    if allowed_commands is None:
        return None
    names = json.dumps(sorted(set(allowed_commands)), separators=(",", ":"), ensure_ascii=False)
    return "commands:" + hashlib.sha256(names.encode("utf-8")).hexdigest()


def shell_view(origin: str | None) -> EventView:
    return SHELL_VIEW if origin is None else EventView(_SHELL_SCOPE, None, origin)


@dataclass(frozen=True, slots=True)
class Audience:
    """What one socket may see: its assertion's scopes, its `allowed_paths` resolved to
    absolute real paths (None: all of agent.cwd), and the origin of its `allowed_commands`
    (None: no limit)."""

    scopes: frozenset[str]
    allowed: tuple[str, ...] | None
    commands: str | None = None

    @property
    def sees_everything(self) -> bool:
        """No check can hide anything from it (the common case: the control plane's own
        socket), so its sender skips the per-event test."""
        return (
            self.allowed is None
            and self.commands is None
            and all(scope in self.scopes for scope in TOOL_SCOPES.values())
        )


def visible(view: EventView, audience: Audience) -> bool:
    if view.scope is None:
        return True
    if view.scope not in audience.scopes:
        return False
    if audience.commands is not None and view.scope == _SHELL_SCOPE and view.commands != audience.commands:
        return False
    if view.path is None or audience.allowed is None:
        return True
    return any(is_within(view.path, allowed) for allowed in audience.allowed)


def is_path_bound(tool_name: str | None) -> bool:
    return tool_name in _PATH_BOUND_TOOLS


def result_view(
    tool_name: str | None, error_code: str | None, path: str | None, origin: str | None = None
) -> EventView:
    """The view of a call's tool.result that ran (or was refused while running). `path`: the
    real path a file tool resolved, None when it did not get that far — then a failure is
    not bound to a path (it can tell nothing of one) and a success is bound to an unknown one."""
    scope = TOOL_SCOPES.get(tool_name or "")
    if scope is None:
        return PUBLIC  # not a tool we run: only a refusal can have this name
    if not is_path_bound(tool_name):
        return EventView(scope, None, origin if scope == _SHELL_SCOPE else None)
    if path is not None:
        return EventView(scope, path)
    if error_code is not None:
        return EventView(scope, None)
    return EventView(scope, UNKNOWN_PATH)


def call_result_view(body: Mapping[str, Any], path: str | None, origin: str | None = None) -> EventView:
    """`result_view` of a tool.result body."""
    error = body.get("error") or {}
    return result_view(body.get("tool_name"), error.get("code"), path, origin)


def event_view(kind: str, origin: str | None) -> EventView:
    """The view of an `exec.*` event of a command run under `origin`."""
    if kind in (EXEC_STARTED, EXEC_OUTPUT, EXEC_COMPLETED):
        return shell_view(origin)
    raise ValueError(f"not a shell event kind: {kind!r}")


def default_view(kind: str, tool_name: str | None = None, error_code: str | None = None) -> EventView:
    """The view of an event from what it says alone, for rows journaled before views
    existed: `exec.*` are the shell's; a file tool's tool.result has an unknown path, failures
    included (an old error may carry a file's sha), except `path_outside_workspace`."""
    if kind in (EXEC_STARTED, EXEC_OUTPUT, EXEC_COMPLETED):
        return SHELL_VIEW
    if kind == TOOL_RESULT:
        view = result_view(tool_name, error_code, None)
        if view.scope is not None and is_path_bound(tool_name) and error_code != PATH_OUTSIDE_WORKSPACE:
            return EventView(view.scope, UNKNOWN_PATH)
        return view
    raise ValueError(f"not a journaled event kind: {kind!r}")
