"""The user commands run as (`[exec] user`), and what that user must not be able to write.

Commands are the agent's code. When they run as the daemon's own user they can rewrite the
sqlite state, read the journal, signal the daemon and replace its socket; run as another,
unprivileged user (docs/operations.md, "Privilege separation") they can do none of that, as
long as nothing the daemon trusts is writable by that user. `unsafe_paths` is that check, a
pure function over stat results; `writable_paths` runs it on the real file system.

Only the standard library here: `config` resolves the configured names with it at load, so an
unknown user is a configuration error, not a failure at the first command.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "CommandIdentity",
    "account_environment",
    "check_group",
    "check_user",
    "can_switch_user",
    "resolve_identity",
    "unsafe_paths",
    "writable_paths",
]

ROOT_UID = 0


@dataclass(frozen=True, slots=True)
class CommandIdentity:
    """Who commands run as: exactly this uid, gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    # From the passwd entry; None for a numeric uid without one (containers often have none).
    name: str | None = None
    home: str | None = None
    shell: str | None = None

    @property
    def gids(self) -> frozenset[int]:
        """Every group whose permission bits apply to this user's processes."""
        return frozenset((self.gid, *self.groups))

    def environment(self) -> dict[str, str]:
        """HOME, USER, LOGNAME and SHELL as a login would set them for this user. Layered over
        `[exec] base_env` and under the bootstrap's agent.env and the call's env
        (shell.build_environment), so an explicit setting still wins."""
        return _login_environment(self.name, self.home, self.shell)


def _login_environment(name: str | None, home: str | None, shell: str | None) -> dict[str, str]:
    env: dict[str, str] = {}
    if home:
        env["HOME"] = home
    if name:
        env["USER"] = name
        env["LOGNAME"] = name
    if shell:
        env["SHELL"] = shell
    return env


def account_environment(identity: CommandIdentity | None) -> dict[str, str]:
    """HOME, USER, LOGNAME and SHELL of whoever commands run as: `identity`'s, or with None
    (no `[exec] user`, or a daemon that cannot switch) the daemon's own effective user's, who
    is then the one running them. Empty for a uid without a passwd entry. Read once at start:
    passwd does not change under a running sandbox's daemon."""
    if identity is not None:
        return identity.environment()
    try:
        entry = pwd.getpwuid(os.geteuid())
    except KeyError:
        return {}
    return _login_environment(entry.pw_name, entry.pw_dir, entry.pw_shell)


def _lookup_user(user: str | int) -> tuple[int, pwd.struct_passwd | None]:
    if isinstance(user, int):
        if user < 0:
            raise ValueError(f"user id {user} must not be negative")
        try:
            return user, pwd.getpwuid(user)
        except KeyError:
            return user, None  # a bare uid is allowed; it has no HOME/USER to give
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"unknown user {user!r} (no passwd entry)") from None
    return entry.pw_uid, entry


def _lookup_group(group: str | int) -> int:
    if isinstance(group, int):
        if group < 0:
            raise ValueError(f"group id {group} must not be negative")
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {group!r} (no group entry)") from None


def check_user(user: str | int) -> None:
    """ValueError unless `user` names a user (a uid needs no passwd entry)."""
    _lookup_user(user)


def check_group(group: str | int) -> None:
    """ValueError unless `group` names a group (a gid needs no group entry)."""
    _lookup_group(group)


def resolve_identity(
    user: str | int, group: str | int | None, supplementary: Sequence[str | int]
) -> CommandIdentity:
    """The identity `[exec] user/group/supplementary_groups` name; ValueError naming what is
    unknown. Without a group, the user's primary group from passwd (a bare uid needs one)."""
    uid, entry = _lookup_user(user)
    if group is not None:
        gid = _lookup_group(group)
    elif entry is not None:
        gid = entry.pw_gid
    else:
        raise ValueError(f"user id {uid} has no passwd entry: set [exec] group too")
    if uid == ROOT_UID:
        # Separation from root is no separation; refuse rather than pretend.
        raise ValueError("the command user must not be root (uid 0)")
    groups = tuple(dict.fromkeys(_lookup_group(g) for g in supplementary))
    return CommandIdentity(
        uid=uid,
        gid=gid,
        groups=groups,
        name=entry.pw_name if entry else None,
        home=entry.pw_dir if entry else None,
        shell=entry.pw_shell if entry else None,
    )


def can_switch_user() -> bool:
    """True when this process may start commands as another user. Root can; a non-root
    daemon with CAP_SETUID and CAP_SETGID could too, which is not detected yet (such a daemon
    runs commands as itself and says so: docs/operations.md)."""
    return os.geteuid() == ROOT_UID


class StatLike(Protocol):
    @property
    def st_mode(self) -> int: ...
    @property
    def st_uid(self) -> int: ...
    @property
    def st_gid(self) -> int: ...


def writable_by(info: StatLike, uid: int, gids: Iterable[int]) -> bool:
    """Whether a process with `uid` and `gids` can write (or, as owner, chmod itself into
    writing) the file or directory `info` describes. POSIX ACLs are not read."""
    if uid == ROOT_UID or info.st_uid == uid:
        return True  # an owner can always chmod u+w
    if info.st_gid in set(gids):
        return bool(info.st_mode & stat.S_IWGRP)
    return bool(info.st_mode & stat.S_IWOTH)


def unsafe_paths(chain: Sequence[tuple[str, StatLike]], identity: CommandIdentity) -> list[str]:
    """The entries of `chain` (a path and its ancestors, root first, the path last) that the
    command user could write, each as the reason to refuse.

    A writable directory lets its writer rename or replace what is in it, so every ancestor
    counts — except a sticky one (like /tmp, 1777), in which only an entry's owner may rename
    or remove it: there the next entry, checked itself, must not be the user's.
    """
    problems = []
    for index, (path, info) in enumerate(chain):
        if not writable_by(info, identity.uid, identity.gids):
            continue
        following = chain[index + 1][1] if index + 1 < len(chain) else None
        sticky = stat.S_ISDIR(info.st_mode) and bool(info.st_mode & stat.S_ISVTX)
        if sticky and following is not None and following.st_uid != identity.uid:
            continue
        problems.append(f"{path} is writable by the command user (uid {identity.uid})")
    return problems


def _chain(path: Path) -> list[tuple[str, os.stat_result]]:
    absolute = Path(os.path.abspath(path))
    return [(str(p), os.stat(p)) for p in (*reversed(absolute.parents), absolute)]


def writable_paths(paths: Iterable[Path], identity: CommandIdentity) -> list[str]:
    """`unsafe_paths` for each path in `paths` and its ancestors, on the real file system
    (symlinks followed, as the daemon's own opens follow them). For a missing path, its
    deepest existing ancestor is checked: the daemon creates the rest (0700) itself, inside
    it, where a writable ancestor could still swap it."""
    problems: list[str] = []
    for path in paths:
        existing = Path(os.path.abspath(path))
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        # The path as written and as resolved: a symlink whose target sits in a directory the
        # user can write is as unsafe as that directory itself.
        chains = [_chain(existing), _chain(Path(os.path.realpath(existing)))]
        for problem in (p for chain in chains for p in unsafe_paths(chain, identity)):
            if problem not in problems:
                problems.append(problem)
    return problems
