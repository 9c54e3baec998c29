"""A socket's audience: what its assertion lets it see of the journal (docs/protocol.md §9.1).

The rule is `state.visibility`'s. This resolves the assertion's `allowed_paths` with the
jail's own walk from the opened agent.cwd (`paths.allowed_real_paths`), so that what a socket
may see and what it may open are decided by one rule; comparing an event's real path with
the result is then a string check per event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots, allowed_real_paths
from sandbox_supervisor.daemon.state.visibility import Audience, commands_origin


def audience_for(
    roots: WorkspaceRoots,
    scopes: Iterable[str],
    allowed_paths: Sequence[str] | None,
    allowed_commands: Sequence[str] | None,
    cwd: str,
) -> Audience:
    """Without allowed_paths, all of agent.cwd; with them, what they resolve to now (nothing,
    when agent.cwd cannot be opened). Commands: the origin of allowed_commands."""
    origin = commands_origin(allowed_commands)
    if allowed_paths is None:
        return Audience(frozenset(scopes), None, origin)
    try:
        root = roots.get(cwd)
    except ToolFailure:
        return Audience(frozenset(scopes), (), origin)
    return Audience(frozenset(scopes), allowed_real_paths(root, allowed_paths), origin)
