"""session.bootstrap: whether a bootstrap binds, re-attaches, or is rejected (docs/protocol.md §5.2).

`decide_binding` is pure apart from the two filesystem probes it is handed, so every rule is
testable without a daemon; the daemon supplies `os.path` functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.bootstrap import BootstrapBody, is_within


@dataclass(frozen=True, slots=True)
class BindAccepted:
    digest: str
    newly_bound: bool  # False for a reconnect with the identical body: nothing is persisted again


@dataclass(frozen=True, slots=True)
class BindRejected:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class BindForbidden:
    """The bootstrap would bind the session, or conflicts with its binding, and the socket
    lacks session:control: refused, and — unlike a rejection — nothing terminates."""



def _inside(path: str, root: str) -> bool:
    # A configured root may end in "/"; is_within takes normalised paths.
    return is_within(path, root.rstrip("/") or "/")


def decide_binding(
    body: BootstrapBody,
    digest: str,
    bound_digest: str | None,
    *,
    workspace_root: str,
    allowed_profiles: Sequence[str],
    may_bind: bool = True,
    is_dir: Callable[[str], bool] = os.path.isdir,
    realpath: Callable[[str], str] = os.path.realpath,
) -> BindAccepted | BindRejected | BindForbidden:
    """`may_bind`: the socket holds session:control (docs/protocol.md §5.2). Without it, only
    the identical body attaches; anything that would bind, or would terminate the sandbox as
    a conflicting claim, is refused before any other check."""
    if bound_digest is not None:
        # A supervisor serves one session for its life: the same body re-attaches, any other
        # body is a conflicting claim on this sandbox.
        if bound_digest == digest:
            return BindAccepted(digest, newly_bound=False)
        if not may_bind:
            return BindForbidden()
        return BindRejected(
            errors.BOOTSTRAP_MISMATCH, "The sandbox is already bound with a different bootstrap."
        )
    if not may_bind:
        return BindForbidden()
    cwd = body.agent.cwd
    real_root = realpath(workspace_root)
    # Lexically inside the root *and* still inside once symlinks are resolved: a symlink in
    # the workspace must not smuggle the agent's cwd elsewhere.
    if not (_inside(cwd, workspace_root) and _inside(realpath(cwd), real_root) and is_dir(cwd)):
        return BindRejected(
            errors.CWD_INVALID, "agent.cwd is not an existing directory inside the workspace root."
        )
    for repository in body.repositories:
        if not is_dir(repository.root):
            return BindRejected(
                errors.REPOSITORY_MISSING,
                f"Repository root of {repository.name!r} does not exist.",
            )
    if allowed_profiles and body.agent.profile not in allowed_profiles:
        return BindRejected(errors.PROFILE_NOT_ALLOWED, "The agent profile is not allowed here.")
    return BindAccepted(digest, newly_bound=True)
