"""The workspace jail (docs/protocol.md §7.2; also the `cwd` of execute_shell_command).

The daemon runs as root and the agent can write the workspace, so it can swap any file or
directory for a symlink at any moment. A jail that resolves a path to a string and lets the
tool open that string later is a check-then-use race: the agent swaps a checked component
for a symlink in between and the root-owned tool reads or writes outside. So the jail
resolves *and opens* on descriptors, and hands the tools descriptors, never a path:

- agent.cwd is opened once (`WorkspaceRoot`, an O_PATH directory descriptor) when the daemon
  learns it: at bootstrap, or at start when it restarts bound. It stays open for the daemon's
  life. If agent.cwd is later renamed and replaced (by a symlink to `/`, say), the jail keeps
  resolving in the directory it opened; the new name is never followed.
- A path is walked one component at a time with `openat(parent, name, O_NOFOLLOW)`: a
  directory gives the next parent descriptor, a symlink is read with `readlinkat` and its
  target walked by hand (relative to the directory that holds it; an absolute target only
  when it names agent.cwd or something under it), `..` goes back to the previous descriptor.
  Nothing is ever resolved by the kernel across more than one component, so a swap at any
  moment yields either the old object or the new one as seen by this walk, and the walk
  judges whichever it saw.
- The final component is opened by the walk too, with the flags the tool needs (read_file:
  O_RDONLY|O_NOFOLLOW) relative to its parent's descriptor; the patch tool creates, renames
  and unlinks with `dir_fd=` that parent. What the tool reads or writes is what was judged.

The rules (unchanged in substance from the path-string jail):
- An absolute `relative`, or an absolute symlink target, is inside when it names agent.cwd
  (as bound, or its real path at the time it was opened) or something under it; `..` may
  leave and re-enter agent.cwd textually (`../proj/x` from `/ws/proj`). Anything else is
  `path_outside_workspace`, as is `..` above agent.cwd that does not come back.
- A path may end in components that do not exist (a file to create). Those are not walked;
  they may not contain `..` (the kernel would refuse to walk `..` out of a directory that
  does not exist). A dangling symlink is followed to where its target would be created.
- A path that resolves to agent.cwd itself is inside the jail: the shell uses it as a
  working directory. The file tools refuse every directory, agent.cwd included, with
  `invalid_parameters` ("is a directory").
- `allowed_paths` entries are walked the same way, and compared with the path's real
  components by whole components (a symlinked `src` admits what its real path holds);
  `None` admits all of agent.cwd, `[]` admits nothing.
- An empty path or one with a NUL byte is not a path at all: `invalid_parameters` (the schema
  already refuses both; this keeps the function total for other callers). More than
  MAX_SYMLINK_HOPS symlinks on the way is a loop: `invalid_parameters`, as the kernel's ELOOP.
- "" and "." components are ignored ("new/" names "new").

The shell's cwd is resolved by the same walk but spawned by path (`JailedPath.real_path`):
the command runs as the command user, who can reach only what that user can reach anyway,
so a swap there gains the agent nothing it did not have.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sandbox_supervisor.protocol.bootstrap import is_within
from sandbox_supervisor.protocol.errors import INVALID_PARAMETERS, NOT_FOUND, PATH_OUTSIDE_WORKSPACE
from sandbox_supervisor.daemon.runtime.failures import FILE_EXHAUSTION_ERRNOS, ToolFailure, resource_failure

__all__ = [
    "DIRECTORY_FLAGS",
    "MAX_SYMLINK_HOPS",
    "READ_FLAGS",
    "JailedPath",
    "PathOutsideWorkspace",
    "WorkspaceRoot",
    "WorkspaceRoots",
    "allowed_real_paths",
    "open_in_jail",
    "open_path",
    "resolve_directory",
    "resolve_in_jail",
]

# The kernel's own bound on symlinks in one resolution (MAXSYMLINKS); more is a loop.
MAX_SYMLINK_HOPS = 40
# A directory on the way: a handle only (no read permission needed), never a symlink.
_WALK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Final-component flags for the file tools: open for reading; O_NONBLOCK so a fifo cannot
# block the open (the tools refuse it after fstat). O_NOFOLLOW is always added by the walk.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
# Final-component flags for a directory (the shell's cwd, allowed_paths entries).
DIRECTORY_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_ROOT_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_PARENT = ".."
_IGNORED_COMPONENTS = frozenset({"", "."})
_DELETED_SUFFIX = " (deleted)"
# Attempts at one component an agent keeps swapping between a symlink and something else.
_SWAP_RETRIES = 3


class PathOutsideWorkspace(ToolFailure):
    """The path leaves agent.cwd or every allowed path (`path_outside_workspace`)."""

    def __init__(self, message: str) -> None:
        super().__init__(PATH_OUTSIDE_WORKSPACE, message)


class _Outside(Exception):
    """The walk left agent.cwd; the caller words the error."""


class _UnresolvablePath(Exception):
    """`..` below a component that does not exist."""


@dataclass(frozen=True)
class WorkspaceRoot:
    """agent.cwd, opened once: every resolution starts from `fd`, never from the path again."""

    fd: int
    given: str  # agent.cwd as bound (normalised): an absolute name for the opened directory
    real: str  # its real path when it was opened: another one, and what the shell spawns in

    @classmethod
    def open(cls, cwd: str, workspace_root: str | None = None) -> WorkspaceRoot:
        """Open agent.cwd; ToolFailure when it is gone or (with `workspace_root`) now lies
        outside the workspace root, which bootstrap required of it."""
        try:
            fd = os.open(cwd, _ROOT_FLAGS)
        except OSError as exc:
            if exc.errno in FILE_EXHAUSTION_ERRNOS:
                # No descriptor left: agent.cwd may well exist, and will open later.
                raise _shortage(exc) from None
            raise ToolFailure(NOT_FOUND, "agent.cwd does not exist or is not a directory.") from None
        except ValueError:
            raise ToolFailure(NOT_FOUND, "agent.cwd does not exist or is not a directory.") from None
        try:
            real = _descriptor_path(fd) or os.path.realpath(cwd)
            if workspace_root is not None and not is_within(real, os.path.realpath(workspace_root)):
                # Replaced by a symlink to elsewhere before the daemon (re)opened it.
                raise PathOutsideWorkspace("agent.cwd now resolves outside the workspace root.")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd=fd, given=os.path.normpath(cwd), real=real)

    def close(self) -> None:
        os.close(self.fd)


class WorkspaceRoots:
    """One daemon's opened agent.cwd (one session for the daemon's life, so one entry in
    practice), keyed by the cwd text that calls carry. Opened when the daemon learns the cwd
    (`prepare`, at bootstrap or at a bound restart) or, failing that, at the first call that
    needs it; kept until `close`. Worker threads use it, hence the lock (taken only to open)."""

    def __init__(self, workspace_root: str | None = None) -> None:
        self.workspace_root = workspace_root
        self._roots: dict[str, WorkspaceRoot] = {}
        self._lock = threading.Lock()

    def get(self, cwd: str) -> WorkspaceRoot:
        root = self._roots.get(cwd)
        if root is not None:
            return root
        with self._lock:
            root = self._roots.get(cwd)
            if root is None:
                root = WorkspaceRoot.open(cwd, self.workspace_root)
                self._roots[cwd] = root
            return root

    def prepare(self, cwd: str) -> None:
        """Open agent.cwd now, as soon as it is known; a failure is left for the calls to
        report (each tries again, so a cwd that reappears is found)."""
        try:
            self.get(cwd)
        except ToolFailure:
            pass

    def close(self) -> None:
        """At the daemon's stop, after its nursery: a read thread abandoned by that stop may
        still hold a root's number, but the process exits next (in-process daemons of the
        tests excepted, where such a thread meets EBADF or, at worst, a reused number)."""
        with self._lock:
            for root in self._roots.values():
                root.close()
            self._roots.clear()


State = Literal["open", "missing", "blocked"]


@dataclass
class JailedPath:
    """Where a path led, as descriptors. Close it (or use `open_in_jail`).

    - state "open": `fd` is the final object opened with the walk's final flags; `name` is
      its entry in `parent_fd` ("." when the path is a directory of the walk itself).
    - state "missing": `tail` are the components below `parent_fd` that do not exist (the
      directories to create, then the file's name).
    - state "blocked": `tail[0]` exists but is not a directory, and more components follow.
    """

    root: WorkspaceRoot
    stack: list[int]  # directory descriptors from the root (excluded) to the parent
    names: list[str]  # their real names, from agent.cwd down
    state: State = "open"
    name: str = "."
    fd: int | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def parent_fd(self) -> int:
        return self.stack[-1] if self.stack else self.root.fd

    @property
    def components(self) -> list[str]:
        """The real components below agent.cwd this path names (what allowed_paths judge)."""
        last = [] if self.name == "." else [self.name]
        return self.names + (last if self.state == "open" else self.tail)

    @property
    def real_path(self) -> Path:
        """The path as text, for the shell's spawn and for messages; never opened by the
        file tools."""
        return Path(self.real_text)

    @property
    def real_text(self) -> str:
        """`real_path` as a string, joined without pathlib (a read_file's hot path: the
        result's view names it). agent.cwd's real path is absolute and normalised, and the
        components are real entry names, so the join is what Path would make of them."""
        base, parts = self.root.real, self.components
        if not parts:
            return base
        return (base if base.endswith("/") else base + "/") + "/".join(parts)

    def take_fd(self) -> int:
        """The final descriptor, handed over to the caller (who closes it)."""
        fd = self.fd
        assert fd is not None
        self.fd = None
        return fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        while self.stack:
            os.close(self.stack.pop())


@contextmanager
def open_path(path: Path, final_flags: int) -> Iterator[JailedPath]:
    """A path the caller vouches for (tests, tools run by hand), opened the way the jail opens
    one, from "/": the file functions then have a single, descriptor-based code path."""
    root = WorkspaceRoot.open("/")
    try:
        with open_in_jail(root, str(Path(path).absolute()), None, final_flags) as jailed:
            yield jailed
    finally:
        root.close()


def resolve_in_jail(cwd: str, relative: str, allowed_paths: Sequence[str] | None) -> Path:
    """The real path of `relative` in a freshly opened agent.cwd (tests of the rules, callers
    without the daemon's WorkspaceRoots); the file tools use `open_in_jail` instead."""
    root = WorkspaceRoot.open(cwd)
    try:
        return resolve_directory(root, relative, allowed_paths)
    finally:
        root.close()


def resolve_directory(
    root: WorkspaceRoot, relative: str, allowed_paths: Sequence[str] | None = None
) -> Path:
    """The real path `relative` leads to from `root`, for code that spawns by path (the
    shell's cwd): judged by the descriptor walk, used as text."""
    try:
        with open_in_jail(root, relative, allowed_paths, DIRECTORY_FLAGS) as jailed:
            return jailed.real_path
    except OSError as exc:
        if exc.errno in FILE_EXHAUSTION_ERRNOS:
            raise _shortage(exc) from None
        raise ToolFailure(INVALID_PARAMETERS, f"The path cannot be resolved: {exc.strerror}.") from None


def _shortage(exc: OSError) -> ToolFailure:
    """A walk cut short by the machine (no descriptor left, say), not by the path: the
    caller's answer is `resource_exhausted`, never a verdict on the path."""
    return resource_failure(f"The path could not be resolved: {exc.strerror}; retry later.")


@contextmanager
def open_in_jail(
    root: WorkspaceRoot, relative: str, allowed_paths: Sequence[str] | None, final_flags: int
) -> Iterator[JailedPath]:
    """Walk `relative` from `root`, opening the final component with `final_flags`
    (O_NOFOLLOW added); the descriptors are closed on exit.

    Raises PathOutsideWorkspace for escapes (`..` out, absolute elsewhere, a symlink or
    symlinked parent pointing out, an allowed_paths miss, `..` after a missing directory) and
    ToolFailure(invalid_parameters) for an empty path, a NUL byte or a symlink loop. OSError
    from the final open (EACCES, ENXIO...) passes through for the tool to word.
    """
    if relative == "":
        raise ToolFailure(INVALID_PARAMETERS, "The path is empty.")
    if "\x00" in relative:
        raise ToolFailure(INVALID_PARAMETERS, "The path contains a NUL byte.")
    jailed = _walk_or_refuse(root, relative, final_flags)
    try:
        if allowed_paths is not None:
            wanted = jailed.components
            if not any(_admits(root, allowed, wanted) for allowed in allowed_paths):
                raise PathOutsideWorkspace(f"Path {relative!r} is not under any of allowed_paths.")
        yield jailed
    finally:
        jailed.close()


def _walk_or_refuse(root: WorkspaceRoot, relative: str, final_flags: int) -> JailedPath:
    try:
        return _walk(root, relative, final_flags)
    except _Outside:
        raise PathOutsideWorkspace(f"Path {relative!r} resolves outside agent.cwd.") from None
    except _UnresolvablePath:
        raise PathOutsideWorkspace(
            f"Path {relative!r} walks '..' out of a directory that does not exist."
        ) from None


def allowed_real_paths(root: WorkspaceRoot, allowed_paths: Sequence[str]) -> tuple[str, ...]:
    """The real paths `allowed_paths` name, walked exactly as `open_in_jail` judges them (an
    entry that cannot be resolved admits nothing, and is left out): what decides which
    journaled results a socket may see (docs/protocol.md §9.1) is the rule that decides which
    paths it may open."""
    found: list[str] = []
    for allowed in allowed_paths:
        if allowed == "" or "\x00" in allowed:
            continue
        try:
            entry = _walk(root, allowed, DIRECTORY_FLAGS)
        except (_Outside, _UnresolvablePath, ToolFailure, OSError):
            continue
        try:
            found.append(entry.real_text)
        finally:
            entry.close()
    return tuple(found)


def _admits(root: WorkspaceRoot, allowed: str, wanted: list[str]) -> bool:
    if allowed == "" or "\x00" in allowed:
        return False  # the assertion schema refuses these; they admit nothing
    try:
        entry = _walk(root, allowed, DIRECTORY_FLAGS)
    except (_Outside, _UnresolvablePath, ToolFailure, OSError):
        return False  # an entry that cannot be resolved admits nothing
    try:
        prefix = entry.components
    finally:
        entry.close()
    # Whole components: "src" admits "src" and "src/x", not "srcx".
    return wanted[: len(prefix)] == prefix


def _components(text: str) -> list[str]:
    return [part for part in text.split("/") if part not in _IGNORED_COMPONENTS]


def _walk(root: WorkspaceRoot, relative: str, final_flags: int) -> JailedPath:
    jailed = JailedPath(root=root, stack=[], names=[])
    try:
        _walk_into(jailed, relative, final_flags | os.O_NOFOLLOW)
    except BaseException:
        jailed.close()
        raise
    return jailed


def _walk_into(jailed: JailedPath, relative: str, final_flags: int) -> None:
    root = jailed.root
    pending: deque[str] = deque()
    # Components still to walk "above" agent.cwd after a `..` out of it: None while inside,
    # else how many of agent.cwd's real components the text is at (0 is "/").
    above: int | None = None
    root_parts = _components(root.real)
    hops = 0

    def restart_from(absolute: str) -> int | None:
        """Walk an absolute name: from the root when it names agent.cwd as bound, else
        textually from "/" along agent.cwd's real path."""
        while jailed.stack:
            os.close(jailed.stack.pop())
        jailed.names.clear()
        for alias in (root.given, root.real):
            if absolute == alias or absolute.startswith(alias.rstrip("/") + "/"):
                pending.extendleft(reversed(_components(absolute[len(alias) :])))
                return None
        pending.extendleft(reversed(_components(absolute)))
        return 0 if root_parts else None  # agent.cwd is "/": every absolute name is in it

    if relative.startswith("/"):
        above = restart_from(relative)
    else:
        pending.extend(_components(relative))
    while pending:
        name = pending.popleft()
        if above is not None:
            # Outside agent.cwd, only a way back into it is accepted; nothing is opened.
            if name == _PARENT:
                above = max(above - 1, 0)
            elif above < len(root_parts) and name == root_parts[above]:
                above += 1
            else:
                raise _Outside
            if above == len(root_parts):
                above = None
            continue
        if name == _PARENT:
            if jailed.stack:
                os.close(jailed.stack.pop())
                jailed.names.pop()
            elif root_parts:
                above = len(root_parts) - 1
            # else agent.cwd is "/", whose ".." is itself
            continue
        last = not pending
        opened = _open_component(jailed, name, pending, final_flags if last else _WALK_FLAGS, last)
        if opened is None:
            return  # missing or blocked: the tail is recorded
        if isinstance(opened, str):
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise ToolFailure(INVALID_PARAMETERS, "The path runs into a symlink loop.")
            if opened.startswith("/"):
                above = restart_from(opened)
            else:
                pending.extendleft(reversed(_components(opened)))
            continue
        fd = opened
        if last:
            jailed.name, jailed.fd = name, fd
            return
        jailed.stack.append(fd)
        jailed.names.append(name)
    if above is not None:
        raise _Outside
    # The path ends at a directory of the walk (agent.cwd, or after `..`): open it as such.
    jailed.name, jailed.fd = ".", os.open(".", final_flags, dir_fd=jailed.parent_fd)


def _open_component(
    jailed: JailedPath, name: str, pending: deque[str], flags: int, last: bool
) -> int | str | None:
    """`name` in the current directory: its descriptor, its symlink target (str), or None
    once the tail is recorded (missing, or a non-directory with components after it).

    open(O_NOFOLLOW) fails on a symlink (ELOOP, or ENOTDIR with O_DIRECTORY) and readlink
    then reads it; if the entry was swapped back to a non-symlink between the two calls,
    readlink fails with EINVAL and the open is tried again (a few times), so an agent
    swapping an entry back and forth gets the entry's state at one moment, not an error
    made of two."""
    parent = jailed.parent_fd
    for _ in range(_SWAP_RETRIES):
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            _missing(jailed, name, pending)
            return None
        except OSError as exc:
            if exc.errno in FILE_EXHAUSTION_ERRNOS:
                raise _shortage(exc) from None
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                if last and exc.errno != errno.ENAMETOOLONG:
                    raise  # the final object exists but cannot be opened so: the tool words it
                raise ToolFailure(
                    INVALID_PARAMETERS, f"The path cannot be resolved: {exc.strerror}."
                ) from None
        try:
            return os.readlink(name, dir_fd=parent)
        except FileNotFoundError:
            _missing(jailed, name, pending)  # removed since: as missing as it now is
            return None
        except OSError:
            continue  # not a symlink (any more): open it again
    # Still not a symlink: a file where a directory is needed.
    jailed.state, jailed.tail = "blocked", [name, *pending]
    return None


def _missing(jailed: JailedPath, name: str, pending: deque[str]) -> None:
    tail = [name, *pending]
    if _PARENT in tail:
        raise _UnresolvablePath
    jailed.state, jailed.tail = "missing", tail


def _descriptor_path(fd: int) -> str | None:
    """What /proc says the descriptor refers to; None without /proc or for a deleted one."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not real.startswith("/") or real.endswith(_DELETED_SUFFIX):
        return None
    return real
