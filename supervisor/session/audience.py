"""A socket's audience: what its assertion lets it see of the journal (docs/protocol.md §9.1).

The rule is `state.visibility`'s; this resolves the assertion's `allowed_paths` the way the
jail does (against the real path of agent.cwd, following symlinks), once per socket, so that
comparing an event's real path with them is a string check per event.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from sandbox_supervisor.protocol.bootstrap import is_within
from sandbox_supervisor.daemon.state.visibility import Audience


def audience_for(scopes: Iterable[str], allowed_paths: Sequence[str] | None, cwd: str) -> Audience:
    """An entry that resolves outside agent.cwd admits nothing, as in the jail."""
    if allowed_paths is None:
        return Audience(frozenset(scopes), None)
    root = os.path.realpath(cwd)
    resolved = []
    for entry in allowed_paths:
        real = os.path.realpath(os.path.join(root, entry))
        if is_within(real, root):
            resolved.append(real)
    return Audience(frozenset(scopes), tuple(resolved))
