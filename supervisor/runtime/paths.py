"""The workspace jail (docs/protocol.md §7.2; also the `cwd` of execute_shell_command).

A path from the control plane is joined to `agent.cwd` and resolved the way the kernel will
resolve it when the tool opens it: every symlink of the existing part is followed. For a path
that does not exist yet, the deepest existing ancestor is resolved and the remaining
components are appended as they are; those may not contain `..` (the kernel would refuse to walk
`..` out of a directory that does not exist, and a lexical `new/..` would let the text and the
file system disagree). The resolved path must lie inside realpath(agent.cwd) and inside one of
`allowed_paths`, by whole components.

Decisions:
- An absolute `relative` is accepted when it resolves inside agent.cwd: the protocol says the path
  is resolved against agent.cwd, and joining an absolute path to a directory yields the
  absolute path, which the containment check then judges like any other.
- A path that resolves to agent.cwd itself is inside the jail and is returned: the shell tool
  uses it as a working directory. The file tools refuse every directory, agent.cwd included,
  with `invalid_parameters` ("is a directory").
- `allowed_paths` entries are resolved the same way (a symlinked `src` admits what its real
  path holds); `None` admits all of agent.cwd, `[]` admits nothing.
- An empty path or one with a NUL byte is not a path at all: `invalid_parameters` (the schema
  already refuses both; this keeps the function total for other callers).
- "" and "." components are ignored, as the kernel does ("new/" names "new").

Callers do their I/O on the returned real path, never on the joined text. A race in which the
agent swaps a checked directory for a symlink between this check and the write is out of
scope: the sandbox, not this jail, is the security boundary (docs/protocol.md §7.4.2 says the same of
allowed_commands); the jail stops mistakes and confused paths.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from sandbox_supervisor.protocol.bootstrap import is_within
from sandbox_supervisor.protocol.errors import INVALID_PARAMETERS, NOT_FOUND, PATH_OUTSIDE_WORKSPACE
from sandbox_supervisor.daemon.runtime.failures import ToolFailure

__all__ = ["PathOutsideWorkspace", "resolve_in_jail"]

_PARENT = ".."
_O_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC
_DELETED_SUFFIX = " (deleted)"
_IGNORED_COMPONENTS = frozenset({"", "."})


class PathOutsideWorkspace(ToolFailure):
    """The path leaves agent.cwd or every allowed path (`path_outside_workspace`)."""

    def __init__(self, message: str) -> None:
        super().__init__(PATH_OUTSIDE_WORKSPACE, message)


class _UnresolvablePath(Exception):
    """`..` below a component that does not exist."""


def resolve_in_jail(cwd: str, relative: str, allowed_paths: Sequence[str] | None) -> Path:
    """Resolve `relative` against `cwd`; the real path, or ToolFailure when it may not be used.

    Raises PathOutsideWorkspace for escapes (`..`, absolute elsewhere, a symlink or symlinked
    parent pointing out, an allowed_paths miss, `..` after a missing directory) and
    ToolFailure(invalid_parameters) for an empty path, a NUL byte or a symlink loop.
    """
    if relative == "":
        raise ToolFailure(INVALID_PARAMETERS, "The path is empty.")
    if "\x00" in relative:
        raise ToolFailure(INVALID_PARAMETERS, "The path contains a NUL byte.")
    root = _kernel_real_path(cwd) or os.path.realpath(cwd)
    if not os.path.isdir(root):
        # Bootstrap checked agent.cwd; it was removed since. Nothing inside it can be found.
        raise ToolFailure(NOT_FOUND, "agent.cwd does not exist or is not a directory.")
    try:
        resolved = _real_path(os.path.join(root, relative))
    except _UnresolvablePath:
        raise PathOutsideWorkspace(
            f"Path {relative!r} walks '..' out of a directory that does not exist."
        ) from None
    if not is_within(resolved, root):
        raise PathOutsideWorkspace(f"Path {relative!r} resolves outside agent.cwd.")
    if allowed_paths is not None and not any(
        _admits(root, allowed, resolved) for allowed in allowed_paths
    ):
        raise PathOutsideWorkspace(f"Path {relative!r} is not under any of allowed_paths.")
    return Path(resolved)


def _admits(root: str, allowed: str, resolved: str) -> bool:
    if allowed == "" or "\x00" in allowed:
        return False  # the assertion schema refuses these; they admit nothing
    try:
        allowed_real = _real_path(os.path.join(root, allowed))
    except (_UnresolvablePath, ToolFailure):
        return False  # an entry that cannot be resolved admits nothing
    # Whole components: "src" admits "src" and "src/x", not "srcx".
    return is_within(resolved, allowed_real)


def _real_path(path: str) -> str:
    """realpath of the deepest existing ancestor + the remaining components (no `..` in them)."""
    real = _kernel_real_path(path)
    if real is not None:
        return real
    head = path
    missing: list[str] = []
    while not os.path.lexists(head):
        parent, name = os.path.split(head)
        if parent == head:  # "/" always exists; this is only a guard against looping forever
            break
        missing.append(name)
        head = parent
    missing.reverse()
    remaining = [name for name in missing if name not in _IGNORED_COMPONENTS]
    if _PARENT in remaining:
        raise _UnresolvablePath
    return os.path.join(_resolve_existing(head), *remaining)


def _kernel_real_path(path: str) -> str | None:
    """The kernel's own resolution of a path that exists, or None (then the walk decides).

    An O_PATH descriptor opens nothing for I/O and needs no permission on the file itself;
    /proc names the file it refers to. One open, one readlink and one close, where
    os.path.realpath makes an lstat per component: this is most of the jail's cost on the
    read_file path. None when any component is missing, a symlink dangles or loops, the
    file was deleted meanwhile, or /proc is not mounted: the slower walk below handles
    (and reports) those the same way as before.
    """
    try:
        fd = os.open(path, _O_PATH_FLAGS)
    except (OSError, ValueError):
        return None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    finally:
        os.close(fd)
    # "/x (deleted)" is what /proc says of an unlinked file; a real name with that suffix
    # just takes the slow path.
    if not real.startswith("/") or real.endswith(_DELETED_SUFFIX):
        return None
    return real


def _resolve_existing(head: str) -> str:
    try:
        return os.path.realpath(head, strict=True)
    except FileNotFoundError:
        # A dangling symlink on the way: the kernel would create its target, so judge (and
        # use) the target; realpath without strict follows the link text.
        return os.path.realpath(head)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ToolFailure(INVALID_PARAMETERS, "The path runs into a symlink loop.") from None
        raise ToolFailure(
            INVALID_PARAMETERS, f"The path cannot be resolved: {exc.strerror}."
        ) from None
