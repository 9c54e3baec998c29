"""Starting a command by `subprocess.Popen`, with its cgroup and OOM score from its first
instruction: the command host's spawn (command_host.py) and each forked holder's
(holder_forkserver.py), so both start commands the same way (docs/internals.md, "The command
host"). Standard library only: the holders import it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Sequence

from sandbox_supervisor.daemon.runtime import holder
from sandbox_supervisor.daemon.runtime.cgroups import hierarchy_path, parse_mountinfo, parse_proc_cgroup
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec

__all__ = ["IDENTITY_ERRNOS", "Spawner", "close_child_ends", "join_cgroup", "popen_stage"]


class Spawner:
    """How a command is started: `subprocess.Popen` (vfork and exec in C: 0.26 ms on this
    machine against 1.6 ms for holder.spawn's fork running Python code before exec; with a
    command user a fork with a C child, 0.89 ms: bench/README.md), with the command's cgroup
    and OOM score set on the spawning process itself around the spawn, so that the child has
    both from its first instruction (a process inherits its parent's cgroups and
    oom_score_adj at fork) and nothing of the agent's ever runs without them. The spawner
    only passes through: it joins the command's cgroups and raises its own score just before
    the vfork and goes back right after (the child has exec'd by then). `holder.spawn` where
    this cannot be done: a terminal, an ignored SIGCHLD (Popen resets only SIGPIPE and SIGXFSZ
    from an inherited SIG_IGN), a cgroup outside the hierarchies the spawner can find its own
    way back in."""

    def __init__(self) -> None:
        # Set once the spawner could not leave a command's cgroup or lower its score back:
        # from then on every command is started by holder.spawn.
        self.stuck = False
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.oom_fd: int | None = None
        self.own: dict[str, str] | None = None  # its own cgroup path by hierarchy mount point
        # Its own cgroup.procs in each hierarchy it visited, by mount point (None: it
        # cannot go back there, so it never leaves it).
        self.homes: dict[str, str | None] = {}

    @property
    def usable(self) -> bool:
        """Whether Popen may start the next command. SIGCHLD is asked each time: a fork
        server ignores it (the kernel reaps its holders) and each holder it forks gives it
        its default back before it spawns."""
        return not self.stuck and signal.getsignal(signal.SIGCHLD) is not signal.SIG_IGN

    def spawn(self, spec: HolderSpec, stdio: holder.Stdio, pass_fds: tuple[int, ...] = ()) -> int:
        """The command's pid once it exec'd; SpawnError (the child's ends closed) if not."""
        if pass_fds and (not self.usable or stdio.pty_slave is not None):
            raise holder.SpawnError("exec", errno.EINVAL)
        if not self.usable or stdio.pty_slave is not None:
            return holder.spawn(spec, stdio)
        directories = spec.cgroup_directories
        homes = [self._home(directory) for directory in directories]
        if any(home is None for home in homes):
            return holder.spawn(spec, stdio)
        try:
            pid = self._popen(spec, stdio, directories, [h for h in homes if h is not None], pass_fds)
        except holder.SpawnError as exc:
            if exc.stage == "fork" and exc.errno == errno.EAGAIN and directories:
                # The spawner itself took a place in the command's cgroup while it forked: at
                # a pids.max of 1 that was the only one. holder.spawn's child joins alone,
                # so it fits where a command fits (and fails the same way where none does).
                return holder.spawn(spec, stdio)
            close_child_ends(stdio)
            raise
        except BaseException:
            close_child_ends(stdio)
            raise
        close_child_ends(stdio)
        return pid

    def _popen(
        self, spec: HolderSpec, stdio: holder.Stdio, directories: Sequence[str], homes: list[str], pass_fds: tuple[int, ...] = ()
    ) -> int:
        own_score = self._raise_score(spec.oom_score_adj)
        joined: list[str] = []
        try:
            for directory in directories:
                try:
                    join_cgroup(os.path.join(directory, "cgroup.procs"))
                except OSError as exc:
                    raise holder.SpawnError("cgroup", exc.errno or errno.EIO) from None
                joined.append(homes[len(joined)])
            # A command user: setgroups (emptied when none are configured, as holder.spawn
            # does), then the gid, then the uid, in the C child after chdir as root.
            groups = None if spec.uid is None and spec.groups is None else list(spec.groups or ())
            try:
                process = subprocess.Popen(
                    list(spec.argv),
                    cwd=spec.cwd,
                    env=spec.env,
                    stdin=self.devnull if stdio.child_stdin is None else stdio.child_stdin,
                    stdout=stdio.child_stdout,
                    stderr=stdio.child_stderr,
                    start_new_session=True,  # its own session and group: signals reach every descendant
                    user=spec.uid,
                    group=spec.gid,
                    extra_groups=groups,
                    pass_fds=pass_fds,
                )
            except OSError as exc:
                raise holder.SpawnError(popen_stage(exc, spec), exc.errno or errno.EIO) from None
            except (subprocess.SubprocessError, ValueError, TypeError):
                raise holder.SpawnError("exec", errno.EINVAL) from None
        finally:
            for home in reversed(joined):
                try:
                    join_cgroup(home)
                except OSError:
                    # Stuck in a command's cgroup (its kill would end the spawner): never
                    # again. Not seen: the way back was tried before the first visit.
                    self.stuck = True
            self._restore_score(own_score)
        # The caller reaps it (waitpid, pidfd): a return code makes subprocess forget it, so
        # neither its list of unreaped children (`_active`) nor a warning ever touches it.
        process.returncode = 0
        return process.pid

    def prepare(self, spec: HolderSpec) -> None:
        """Find, and prove, the way back from each of `spec`'s cgroups now rather than in the
        next spawn: the fork server does it between requests, and the holders it forks
        later inherit what it found."""
        if not self.stuck:
            for directory in spec.cgroup_directories:
                self._home(directory)

    def _home(self, directory: str) -> str | None:
        """The cgroup.procs of the spawner's own cgroup in `directory`'s hierarchy (None: not
        one it knows, or cannot go back to). Paths, not open descriptors: an open file
        would keep a cgroup file system from being unmounted."""
        if self.own is None:
            try:
                with open("/proc/self/cgroup", encoding="utf-8") as handle:
                    own = parse_proc_cgroup(handle.read())
                with open("/proc/self/mountinfo", encoding="utf-8") as handle:
                    mounts = parse_mountinfo(handle.read())
            except OSError:
                self.stuck = True
                return None
            self.own = {} if own.unified is None else {m: own.unified for m in mounts.unified}
            for controller, mount in mounts.v1.items():
                if controller in own.v1:
                    self.own.setdefault(mount, own.v1[controller])
        found = max((m for m in self.own if directory.startswith(m.rstrip("/") + "/")), key=len, default=None)
        if found is None:
            return None
        if found not in self.homes:
            path = os.path.join(hierarchy_path(found, self.own[found]), "cgroup.procs")
            try:
                join_cgroup(path)  # where it already is: proves the way back is open
            except OSError:
                self.homes[found] = None
            else:
                self.homes[found] = path
        return self.homes[found]

    def _raise_score(self, score: int | None) -> bytes | None:
        """Set the spawner's own oom_score_adj to the command's; the value to restore."""
        if score is None:
            return None
        try:
            if self.oom_fd is None:
                self.oom_fd = os.open(holder.OOM_SCORE_ADJ_FILE, os.O_RDWR | os.O_CLOEXEC)
            own = os.pread(self.oom_fd, 16, 0).strip()
            if own != str(score).encode():
                os.pwrite(self.oom_fd, str(score).encode(), 0)
                return own
        except OSError:
            pass  # best effort, as in holder.spawn's child
        return None

    def _restore_score(self, own: bytes | None) -> None:
        if own is None or self.oom_fd is None:
            return
        try:
            os.pwrite(self.oom_fd, own, 0)
        except OSError:
            # Back down needs CAP_SYS_RESOURCE below the minimum the spawner inherited: left
            # at the command's score, it spawns the old way from now on.
            self.stuck = True


# What setgroups, setgid and setuid fail with (EAGAIN: setuid over the user's RLIMIT_NPROC);
# chdir never does with these.
IDENTITY_ERRNOS = frozenset({errno.EPERM, errno.EINVAL, errno.EAGAIN})


def popen_stage(exc: OSError, spec: HolderSpec) -> str:
    """The stage of a failed Popen, as holder.spawn's child names it. Popen names no file
    for the fork itself (EAGAIN, ENOMEM, in the spawner), the program for exec's own failure,
    and the cwd for any failure of its child before exec: the chdir, but also the switch of
    ids that follows it. Those the errno tells apart (ENOENT for a missing cwd, EPERM for a
    refused setuid), so that a missing cwd never reads as a missing shell nor a refused
    switch of ids as a missing cwd."""
    has_ids = spec.uid is not None or spec.gid is not None or spec.groups is not None
    if exc.filename is None:
        # Python 3.13 and later name no file for a failure of the child before exec other
        # than its chdir (3.11 and 3.12 name the cwd): a refused switch of ids is told from
        # the fork's own failure (EAGAIN, ENOMEM) by its errno.
        return "identity" if has_ids and exc.errno in (errno.EPERM, errno.EINVAL) else "fork"
    if exc.filename != spec.cwd:
        return "exec"
    return "identity" if has_ids and exc.errno in IDENTITY_ERRNOS else "cwd"


def close_child_ends(stdio: holder.Stdio) -> None:
    for fd in {stdio.child_stdin, stdio.child_stdout, stdio.child_stderr}:
        if fd is not None:
            os.close(fd)


def join_cgroup(procs: str) -> None:
    """Move the calling process into the cgroup of `procs` (0: the writer itself)."""
    fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)
