"""The command host: the parent of every `execute_shell_command` command, so that a command's
exit status and output outlive the daemon (docs/internals.md, "The command host").

    python -I -m sandbox_supervisor.daemon.runtime.command_host

stdin is one end of a SOCK_SEQPACKET socket pair whose other end the daemon keeps: one
JSON message per datagram (`command_host_link.py` is the daemon's side). The daemon asks it
to spawn a command (`spawn`: the call's spool directory and a holder spec, `holder_protocol`);
the host starts it with what a holder's spawn gives it (its own session, the command user's
ids, its cgroup and OOM score from its first instruction, stdin on /dev/null), by
`subprocess.Popen` with the cgroup and the score set on the host around the spawn
(`spawner.Spawner`), or by `holder.spawn` where that cannot be done, and answers `spawned` with the pid and, as SCM_RIGHTS, the read ends of the
command's stdout and stderr pipes. It keeps a duplicate of each read end and reaps the
command: `exited` carries the wait status. The daemon reads the pipes, spools, streams and
times out as before; once the call completed it says `done`, and the host forgets the command.

While the daemon lives the host reads nothing: it only holds the pipes open and reaps. When the
daemon's end of the socket closes (the daemon died, or stopped), the host takes over every
command the daemon had not said `done` for: it reads the pipes into the spool itself, resuming
each stream's file where the daemon's writes ended (`SpoolWriter.resume`), enforces the
command's timeout (SIGTERM to its group, SIGKILL after the grace), and once the command
exited and its streams ended, or COMPLETION_GRACE_S after the exit, writes `exit.json` (the
holder's exit record) into the spool directory. Then it exits. The next daemon reports each
such call with its real result instead of `interrupted` (`tools/execute_shell_command.py`).

One host serves every command of a daemon: a spawn costs a message each way and a vfork of
this small process (no interpreter start, no fork of the daemon's larger one), and the OOM
score and cgroup move need no wrapper exec. Standard library only, like the holder whose spawning
it shares: a test checks its modules.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from sandbox_supervisor.daemon.runtime import holder
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    EXIT_FILE,
    ExitRecord,
    HolderSpec,
    SpecError,
    parse_spec,
    write_json_atomic,
)
from sandbox_supervisor.daemon.runtime.spawner import Spawner, close_child_ends
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter
from sandbox_supervisor.protocol.plain import Stream

__all__ = [
    "COMPLETION_GRACE_S",
    "MAX_MESSAGE_BYTES",
    "main",
]

# A spec too large for a datagram is written here, in the call's spool directory (private to
# the daemon's user), and removed once read.
HOST_SPEC_FILE = "host-spec.json"
# One datagram each way; a spec carries the command and its environment (larger ones go by
# file, command_host_link.INLINE_SPEC_MAX_BYTES). Both ends ask for buffers of this size.
MAX_MESSAGE_BYTES = 1024 * 1024
# After a command exited, background descendants may hold its pipes: the exit record waits this
# long for its streams to end, as a completion does (docs/protocol.md §7.4.3).
COMPLETION_GRACE_S = 0.2
READ_CHUNK_BYTES = 256 * 1024
# Without pidfds (kernels before 5.3) exits are noticed by polling waitpid this often.
REAP_POLL_S = holder.REAP_POLL_S
# The standard descriptor the daemon's socket arrives on.
DAEMON_FD = 0


# --- pre-started shells (docs/internals.md, "Pre-started shells") ---------------------------
# The most idle shells the host keeps (`[exec] idle_shells`, validated in config.py to this).
MAX_IDLE_SHELLS = 8
# The shell's `read` takes a command from a socket one byte per system call (about 0.3 µs a
# byte here: 0.6 ms for this size, against the 1.3 ms a fresh shell's start costs): a longer
# command is spawned fresh, where it is not slower than before.
POOL_MAX_COMMAND_BYTES = 2048
# Only bash runs the stub (its `read -d ''`, `eval`); another shell is spawned fresh.
POOL_SHELL_NAME = "bash"
# The variables the stub reads the command into and keeps bash's first `$_` in (both unset
# before the command runs).
POOL_VARIABLE = "__sst_command"
POOL_UNDERSCORE_VARIABLE = "__sst_underscore"
# Environment bash acts on at its start, which would then act on the stub too or happen
# before the call instead of at it: a file sourced at start (BASH_ENV, ENV), options such as
# xtrace (SHELLOPTS, BASHOPTS; BASH_XTRACEFD), SECONDS, and the stub's own variable. With any
# of them, or an exported function (BASH_FUNC_*: it could stand in for a builtin the stub
# uses), the command is spawned fresh.
POOL_UNSAFE_ENV = frozenset(
    {"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "BASH_XTRACEFD", "SECONDS", POOL_VARIABLE, POOL_UNDERSCORE_VARIABLE}
)
POOL_UNSAFE_ENV_PREFIX = "BASH_FUNC_"
# Cgroups the daemon made for idle shells to wait in (the spawn request's `place`,
# ready_cgroups.py), kept until a shell is put in one: at most this many.
MAX_PLACES = 2 * MAX_IDLE_SHELLS
# The calls' cgroups the host remembers, never to offer one of them to an idle shell again.
# The daemon sends requests in the order it hands cgroups out, so an offer never trails its
# call; this is the host's own guard, and a few dozen cover any reordering.
CLAIMED_PLACES = 64
# An idle shell is put in its cgroup only while no command younger than this runs: a move
# can wait an RCU grace period (10-15 ms on a stock kernel after a pause), and the host
# reports no exit meanwhile, so a short command's exit must not wait behind it.
PLACE_AFTER_RUN_S = 0.5
# The replacement for a shell a call took is started once no command of the host runs (the
# call's exit reported), or this long after the answer, whichever comes first. Started at
# once, as before, the start (the pipes, the socket pair and a vfork that waits for bash's
# exec: about 0.4 ms of the host's time here, once the start time's read moved to `take`)
# came between a short command's exit and the host's report of it, and every `true` waited
# for it. A command that runs longer gets its replacement while it runs, as it did.
REFILL_AFTER_S = 0.01
# How long an idle shell killed in the cgroup a command is about to start in is waited for
# (it counts against that cgroup's pids.max until reaped); it waits in a `read` and goes at once.
REAP_IN_CALL_CGROUP_S = 0.1
REAP_IN_CALL_CGROUP_POLL_S = 0.001
# More than a /proc/PID/stat line takes (about 300 bytes; the name in it is at most 16).
STAT_READ_BYTES = 4096


class PendingRefill(NamedTuple):
    """Idle shells to start again for `spec`, asked for since `since` (monotonic)."""

    spec: HolderSpec
    since: float


def refill_wait(pending_since: float | None, now: float, running: bool) -> float | None:
    """Seconds until a pending refill is due (0: now), None when none is pending: due once
    no command runs, or REFILL_AFTER_S after it was asked for."""
    if pending_since is None:
        return None
    if not running:
        return 0.0
    return max(0.0, pending_since + REFILL_AFTER_S - now)


def pool_stub(fd: int) -> str:
    """The `-c` string an idle shell runs: keep bash's first `$_` (quoted), wait for the
    command on descriptor `fd` (a unix socket: /proc/PID/fd/N of a socket cannot be opened,
    so no other process of the command user can write a command into it), close it, reset
    SECONDS, and run the command with `eval` in the same shell, after unsetting both
    variables and a `:` whose last argument gives `$_` back its first value. An end of the
    socket without a whole command (the host died or killed the pool) exits, running
    nothing. IFS empty and -r: the command arrives byte for byte."""
    v, u = POOL_VARIABLE, POOL_UNDERSCORE_VARIABLE
    return (
        f"printf -v {u} %q \"$_\"; IFS= read -r -d '' {v} <&{fd} || exit 0; exec {fd}<&-; SECONDS=0; "
        f"eval \"unset {v} {u}; : ${u};${v}\""
    )


def pool_key(spec: HolderSpec) -> HolderSpec | None:
    """What an idle shell must have been started with to run `spec`: the whole spec except
    the command itself, the call's cgroups (the shell is moved into them) and what only the
    host's takeover uses (timeout, grace, spool cap). None: `spec` is never run pooled (not
    `bash -c <command>`: another shell, a login shell, a terminal; or a long command)."""
    if len(spec.argv) != 3 or spec.argv[1] != "-c" or os.path.basename(spec.argv[0]) != POOL_SHELL_NAME:
        return None
    command = _command_bytes(spec)
    if spec.pty is not None or command is None or len(command) > POOL_MAX_COMMAND_BYTES:
        return None
    if any(name in POOL_UNSAFE_ENV or name.startswith(POOL_UNSAFE_ENV_PREFIX) for name in spec.env):
        return None
    return spec._replace(
        argv=(spec.argv[0], "-c"),
        cgroup=None,
        cgroup_also=(),
        timeout_s=None,
        kill_grace_s=0.0,
        spool_max_bytes=0,
        stdin="null",
    )


def _command_bytes(spec: HolderSpec) -> bytes | None:
    """The command as a fresh shell's argv would carry it (Popen encodes argv so); None for
    one that cannot be encoded (Popen refuses it: the fresh spawn reports that)."""
    try:
        return os.fsencode(spec.argv[-1])
    except UnicodeError:
        return None


Place = tuple[str, ...]  # a cgroup's directories, the membership first (a spec's cgroup, cgroup_also)


class IdleShell(NamedTuple):
    pid: int
    # Its /proc/PID/stat, opened at its start and read when a call takes it (`take`): read at
    # once, the read waits for the new shell's loading (1.7 ms here, against 50 µs later),
    # and the host's loop with it. The pid cannot be reused meanwhile: the host is its parent
    # and has not reaped it. -1: it could not be opened, or it was read and closed.
    stat_fd: int
    outputs: dict[Stream, int]  # the host's read ends of its stdout and stderr
    channel: socket.socket  # the host's end of the socket its command arrives on
    placed: Place = ()  # the cgroup it waits in (ready_cgroups.py); (): the host's own
    start_ticks: int = 0  # its start time, once `take` has read it (0: unknown, as for a spawn)


def read_start_ticks(stat_fd: int) -> int:
    """Field 22 of an open /proc/PID/stat, as holder._start_ticks reads it from the path;
    0 when it cannot be read (a fresh spawn's answer says 0 then too)."""
    try:
        text = os.pread(stat_fd, STAT_READ_BYTES, 0).decode("ascii", "replace")
        return int(text.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def parse_places(value: object) -> list[Place]:
    """A spawn request's `place`: lists of absolute directory paths; anything else is
    ignored (the daemon never sends it, and a shell then waits unplaced, as before)."""
    if not isinstance(value, list):
        return []
    places = []
    for item in value:
        if isinstance(item, list) and item and all(isinstance(d, str) and os.path.isabs(d) for d in item):
            places.append(tuple(item))
    return places


class ShellPool:
    """Shells started ahead of their command, as Spawner starts a command (the command user's
    ids, env, cwd, own session, OOM score, stdin /dev/null, stdout and stderr pipes), each
    waiting on a socket for its command (`pool_stub`). `take` hands one out for a spec whose
    key matches, moved into the call's cgroups before it is sent its command; `refill` starts
    the replacements (after the `spawned` answer). Shells made for another key are killed
    when the key changes. Nothing here ever fails a call: no shell, a dead one, a refused
    cgroup move or a failed send, and the command is spawned as without a pool."""

    def __init__(self, spawner: Spawner, size: int = 0) -> None:
        self.spawner = spawner
        self.size = size
        self.key: HolderSpec | None = None
        self.idle: list[IdleShell] = []
        self.killed: list[int] = []  # killed shells not yet reaped (never blocked on)
        self.places: list[Place] = []  # cgroups offered for idle shells, none in them yet
        self.claimed: collections.deque[Place] = collections.deque(maxlen=CLAIMED_PLACES)  # calls' cgroups

    def offer(self, places: list[Place]) -> None:
        """Cgroups for the next idle shells to wait in (`place_waiting` puts them there).
        Never one that was a call's (`claim`), nor one a shell already waits in."""
        for place in places:
            taken = place in self.places or place in self.claimed or any(shell.placed == place for shell in self.idle)
            if not taken and len(self.places) < MAX_PLACES:
                self.places.append(place)

    def claim(self, spec: HolderSpec) -> None:
        """`spec`'s cgroup is its call's from now on: off offer, for good (the last
        CLAIMED_PLACES are remembered, which covers any offer still on its way)."""
        place = spec.cgroup_directories
        if place:
            with contextlib.suppress(ValueError):
                self.places.remove(place)
            self.claimed.append(place)

    @property
    def placing(self) -> bool:
        """Whether an idle shell waits for a cgroup that is on offer."""
        return bool(self.places) and any(not shell.placed for shell in self.idle)

    def place_waiting(self) -> None:
        """Put each idle shell that waits in the host's own cgroup in one on offer, as root,
        by pid: the move a call then no longer makes. Each failed move gives up the shell or
        the cgroup, so the host's loop never comes back to the same failure: a shell that is
        gone (ESRCH) or was moved into part of the cgroup only is ended, and the cgroup stays
        on offer while all of it is there; a cgroup that refused a shell moved nowhere (it
        went, or is no leaf) leaves the offer, and the shell waits on where it is."""
        ended: list[IdleShell] = []
        for index, shell in enumerate(self.idle):
            if shell.placed or not self.places:
                continue
            place = self.places.pop(0)
            moved = 0
            try:
                for directory in place:
                    _move(os.path.join(directory, "cgroup.procs"), shell.pid)
                    moved += 1
            except OSError as exc:
                if moved or exc.errno == errno.ESRCH:
                    ended.append(shell)
                    if all(os.path.isdir(directory) for directory in place):
                        self.places.insert(0, place)
                continue
            self.idle[index] = shell._replace(placed=place)
        for shell in ended:
            self.idle.remove(shell)
            self._kill(shell)

    def vacate(self, spec: HolderSpec) -> None:
        """A fresh spawn's cgroup holds its command alone: an idle shell that waits there
        (the call is not one it can run) is ended first, and reaped (`_end_in_call_cgroup`)."""
        place = spec.cgroup_directories
        for shell in [shell for shell in self.idle if place and shell.placed == place]:
            self.idle.remove(shell)
            self._end_in_call_cgroup(shell)

    def _end_in_call_cgroup(self, shell: IdleShell) -> None:
        """Kill an idle shell that waits in the cgroup a command is about to start in, and
        reap it, for up to REAP_IN_CALL_CGROUP_S: until reaped it still counts against the
        cgroup's pids.max. It has run nothing and waits in a `read`, so it goes at once."""
        self._kill(shell)
        deadline = time.monotonic() + REAP_IN_CALL_CGROUP_S
        while shell.pid in self.killed and time.monotonic() < deadline:
            self._reap_killed()
            if shell.pid in self.killed:
                time.sleep(REAP_IN_CALL_CGROUP_POLL_S)

    def take(self, spec: HolderSpec) -> IdleShell | None:
        """An idle shell running `spec`'s command in `spec`'s cgroups, or None. The shell
        already waiting in them goes first; another is moved in."""
        self._reap_killed()
        key = pool_key(spec)
        if key is None or key != self.key or not self.size:
            return None
        place = spec.cgroup_directories
        waiting = [shell for shell in self.idle if place and shell.placed == place]
        for shell in waiting:  # to the front, where the loop below starts
            self.idle.remove(shell)
            self.idle.insert(0, shell)
        while self.idle:
            shell = self.idle.pop(0)  # the oldest: the longest settled
            state = self._state(shell.pid)
            if state != "waiting":
                if state == "gone":
                    self._close(shell)
                else:
                    self._end(shell, place)
                self._free_place(shell, place)
                continue
            if not _same_directory(shell.pid, spec.cwd):
                # The cwd was removed or replaced since the shell entered it: a fresh spawn
                # enters the directory the path names now (or fails as it always did).
                self._end(shell, place)
                self._free_place(shell, place)
                continue
            shell = _with_start_ticks(shell)  # while it still waits for its command
            try:
                # Into the call's cgroups before it has its command: nothing of the agent's
                # runs outside them. As root, by pid (the shell cannot move itself). One
                # placed there ahead has nothing to move.
                if shell.placed != place:
                    for directory in place:
                        _move(os.path.join(directory, "cgroup.procs"), shell.pid)
                    self._free_place(shell)  # the one it left is empty: for the next idle shell
                shell.channel.sendall(os.fsencode(spec.argv[2]) + b"\0")  # pool_key: it encodes
            except OSError:
                # A cgroup gone or refused, or a shell that died: the spawn as without a pool
                # (which reports a vanished cgroup as it always did).
                self._end(shell, place)
                self._free_place(shell, place)
                return None
            shell.channel.close()
            return shell
        return None

    def refill(self, spec: HolderSpec) -> None:
        """Start idle shells for `spec`'s key up to the size; those of another key are killed."""
        self._reap_killed()
        key = pool_key(spec)
        if key is None or not self.size or not self.spawner.usable:
            return
        if key != self.key:
            self.clear()
            self.key = key
        while len(self.idle) < self.size:
            shell = self._start(key)
            if shell is None:
                return
            self.idle.append(shell)

    def resize(self, size: int) -> None:
        self.size = max(0, min(size, MAX_IDLE_SHELLS))
        while len(self.idle) > self.size:
            shell = self.idle.pop()
            self._kill(shell)
            self._free_place(shell)

    def clear(self) -> None:
        """Kill every idle shell (the key changed, the daemon is gone)."""
        while self.idle:
            shell = self.idle.pop()
            self._kill(shell)
            self._free_place(shell)
        self._reap_killed()

    def _start(self, key: HolderSpec) -> IdleShell | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            stdio = holder.open_stdio(key)
        except OSError:
            ours.close()
            theirs.close()
            return None
        ours.set_inheritable(False)
        stub = key._replace(argv=(key.argv[0], "-c", pool_stub(theirs.fileno())))
        try:
            pid = self.spawner.spawn(stub, stdio, (theirs.fileno(),))
        except (holder.SpawnError, OSError) as exc:
            if not isinstance(exc, holder.SpawnError):  # the fork itself: the ends are still open
                close_child_ends(stdio)
            ours.close()
            for fd in stdio.outputs.values():
                os.close(fd)
            return None
        finally:
            theirs.close()
        try:
            stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            stat_fd = -1
        return IdleShell(pid, stat_fd, dict(stdio.outputs), ours)

    @staticmethod
    def _state(pid: int) -> str:
        """"waiting", "stopped" (by a signal: it would hold its call until the timeout, where a
        fresh shell runs) or "gone" (it exited, and is reaped now: its pid must not be
        signalled any more). One waitid that consumes nothing (WNOWAIT), then a reap."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return "gone"
        if info is None:
            return "waiting"
        if info.si_code == os.CLD_STOPPED:
            return "stopped"
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # it exited: the status is there, this does not block
        return "gone"

    def _kill(self, shell: IdleShell) -> None:
        with contextlib.suppress(OSError):
            os.killpg(shell.pid, signal.SIGKILL)
        self.killed.append(shell.pid)
        self._close(shell)

    def _end(self, shell: IdleShell, call_place: Place) -> None:
        """Kill a shell the call will not use; reaped first when it is in the call's cgroup."""
        if call_place and shell.placed == call_place:
            self._end_in_call_cgroup(shell)
        else:
            self._kill(shell)

    def _free_place(self, shell: IdleShell, call_place: Place = ()) -> None:
        """A shell gone from the pool leaves its cgroup on offer for the next one (one killed
        there ran nothing, and leaves it at its exit), unless that cgroup is the call's."""
        if shell.placed and shell.placed != call_place:
            self.offer([shell.placed])

    @staticmethod
    def _close(shell: IdleShell) -> None:
        shell.channel.close()
        for fd in shell.outputs.values():
            os.close(fd)
        if shell.stat_fd >= 0:
            os.close(shell.stat_fd)

    def _reap_killed(self) -> None:
        for pid in list(self.killed):
            try:
                done = os.waitpid(pid, os.WNOHANG)[0] != 0
            except ChildProcessError:
                done = True
            if done:
                self.killed.remove(pid)


def _with_start_ticks(shell: IdleShell) -> IdleShell:
    """`shell` with its start time read, and its stat descriptor closed."""
    if shell.stat_fd < 0:
        return shell
    ticks = read_start_ticks(shell.stat_fd)
    os.close(shell.stat_fd)
    return shell._replace(stat_fd=-1, start_ticks=ticks)


def _same_directory(pid: int, path: str) -> bool:
    """Whether process `pid`'s working directory is the directory `path` names now."""
    try:
        here, there = os.stat(f"/proc/{pid}/cwd"), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _move(procs: str, pid: int) -> None:
    """Move process `pid` into the cgroup of `procs`."""
    fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(pid).encode())
    finally:
        os.close(fd)


class Hosted:
    """One command: its pid, the host's duplicates of its pipes, and how it ended."""

    def __init__(self, call_id: str, directory: Path, spec: HolderSpec, pid: int, outputs: dict[Stream, int]) -> None:
        self.call_id = call_id
        self.directory = directory
        self.spec = spec
        self.pid = pid
        self.outputs = outputs  # the host's read ends, by stream
        self.started = time.monotonic()
        self.pidfd: int | None = None
        self.status: int | None = None  # the wait status, once reaped
        self.exited_at: float | None = None
        self.writers: dict[Stream, SpoolWriter] = {}
        self.truncated: set[str] = set()  # streams whose daemon-side writer dropped bytes
        self.done = False  # the daemon completed the call: no exit record is needed
        self.timeout_at = None if spec.timeout_s is None else self.started + spec.timeout_s
        self.kill_at: float | None = None
        self.timed_out = False
        self.recorded = False


class Host:
    def __init__(self, daemon: socket.socket) -> None:
        self.daemon: socket.socket | None = daemon
        self.selector = selectors.DefaultSelector()
        self.commands: dict[str, Hosted] = {}
        self.spawner = Spawner()
        self.pool = ShellPool(self.spawner)  # sized by each spawn request (`idle_shells`)
        daemon.setblocking(True)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                daemon.setsockopt(socket.SOL_SOCKET, option, MAX_MESSAGE_BYTES)
            except OSError:
                pass
        self.selector.register(daemon, selectors.EVENT_READ, self._on_daemon)
        self.pending_refill: PendingRefill | None = None  # due as `refill_wait` says

    # -- the loop --

    def run(self) -> None:
        while self.daemon is not None or self.commands:
            for key, mask in self.selector.select(self._select_timeout()):
                key.data(mask)
            for command in list(self.commands.values()):
                if command.pidfd is None and command.status is None:
                    self._reap(command)
            if self._refill_wait() == 0:
                self._refill()
            if self.daemon is None:
                self._timers()
            elif self.pool.placing and self._placing_due() <= 0:
                self.pool.place_waiting()

    def _placing_due(self) -> float:
        """Seconds until idle shells may be moved into their cgroups: once no command
        younger than PLACE_AFTER_RUN_S runs (0: now)."""
        now = time.monotonic()
        young = [c.started for c in self.commands.values() if c.status is None and now - c.started < PLACE_AFTER_RUN_S]
        return max(0.0, max(young) + PLACE_AFTER_RUN_S - now) if young else 0.0

    def _refill_wait(self) -> float | None:
        running = any(command.status is None for command in self.commands.values())
        pending = self.pending_refill
        return refill_wait(None if pending is None else pending.since, time.monotonic(), running)

    def _refill_later(self, spec: HolderSpec) -> None:
        """Ask for `spec`'s idle shells to be started again (`refill_wait` says when): after
        the answer, off the call's path. A refill already pending keeps its time, for the
        newest spec."""
        pending = self.pending_refill
        self.pending_refill = PendingRefill(spec, time.monotonic() if pending is None else pending.since)

    def _refill(self) -> None:
        pending, self.pending_refill = self.pending_refill, None
        if pending is not None and self.daemon is not None:
            self.pool.refill(pending.spec)

    def _select_timeout(self) -> float | None:
        polled = any(c.pidfd is None and c.status is None for c in self.commands.values())
        if self.daemon is not None:
            timeout = REAP_POLL_S if polled else None
            refill = self._refill_wait()
            if refill is not None:
                timeout = refill if timeout is None else min(timeout, refill)
            if self.pool.placing:
                placing = self._placing_due()
                timeout = placing if timeout is None else min(timeout, placing)
            return timeout
        now = time.monotonic()
        due = [t for c in self.commands.values() for t in (c.timeout_at, c.kill_at) if t is not None]
        due += [c.exited_at + COMPLETION_GRACE_S for c in self.commands.values() if c.exited_at is not None]
        if polled:
            due.append(now + REAP_POLL_S)
        return max(0.0, min(due) - now) if due else None

    # -- the daemon's messages --

    def _on_daemon(self, _mask: int) -> None:
        assert self.daemon is not None
        try:
            data = self.daemon.recv(MAX_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self._take_over()
            return
        try:
            message = json.loads(data)
            op = message["op"]
            call_id = str(message["id"])
        except (ValueError, KeyError, TypeError):
            return  # the daemon never sends these; nothing to answer
        if op == "spawn":
            self._spawn(call_id, message)
        elif op == "done":
            self._forget(call_id)
        elif op == "truncated" and call_id in self.commands and message.get("stream") in ("stdout", "stderr"):
            self.commands[call_id].truncated.add(message["stream"])

    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.daemon is None:
            return
        data = json.dumps(message).encode()
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self.daemon.sendmsg([data], ancillary)
        except OSError:
            pass  # the daemon is gone: its end's EOF comes next and starts the takeover

    def _spawn(self, call_id: str, message: dict[str, Any]) -> None:
        try:
            directory = Path(str(message["dir"]))
            if "spec_file" in message:  # a large one: written beside the spool, read once
                spec_path = directory / HOST_SPEC_FILE
                try:
                    document = json.loads(spec_path.read_text(encoding="utf-8"))
                finally:
                    with contextlib.suppress(OSError):
                        spec_path.unlink()
            else:
                document = message["spec"]
            # execute_shell_command: stdin on /dev/null, no terminal.
            spec = parse_spec(document)._replace(pty=None, stdin="null")
        except (KeyError, ValueError, OSError, SpecError) as exc:
            self._send({"op": "failed", "id": call_id, "stage": "spec", "errno": 0, "message": str(exc)})
            return
        self.pool.claim(spec)  # refused or not, the daemon has handed this cgroup to a call
        if call_id in self.commands:
            self.pool.vacate(spec)  # the daemon removes the cgroup after a refusal
            self._send({"op": "failed", "id": call_id, "stage": "spec", "errno": 0, "message": "call_id in use"})
            return
        idle_shells = message.get("idle_shells", 0)
        self.pool.resize(idle_shells if isinstance(idle_shells, int) and not isinstance(idle_shells, bool) else 0)
        self.pool.offer(parse_places(message.get("place")))
        shell = self.pool.take(spec)
        if shell is not None:
            # The shell's start time is its identity (with the pid) for a restart's clean-up
            # and adoption; it precedes the call (docs/internals.md, "Pre-started shells").
            self._started(Hosted(call_id, directory, spec, shell.pid, shell.outputs), shell.start_ticks)
            self._refill_later(spec)
            return
        self.pool.vacate(spec)  # a fresh spawn's cgroup holds the command alone
        try:
            stdio = holder.open_stdio(spec)
        except OSError as exc:
            self._send({"op": "failed", "id": call_id, "stage": "stdio", "errno": exc.errno or 0, "message": str(exc)})
            return
        try:
            pid = self.spawner.spawn(spec, stdio)
        except (holder.SpawnError, OSError) as exc:
            # SpawnError: the child failed (spawn closed the child's ends); OSError: the fork
            # itself (EAGAIN, ENOMEM), which left them open.
            ends = [] if isinstance(exc, holder.SpawnError) else [stdio.child_stdout, stdio.child_stderr]
            for fd in [*stdio.outputs.values(), *ends]:
                os.close(fd)
            stage, code = (exc.stage, exc.errno) if isinstance(exc, holder.SpawnError) else ("fork", exc.errno or 0)
            self._send({"op": "failed", "id": call_id, "stage": stage, "errno": code, "message": str(exc)})
            return
        try:
            ticks = holder._start_ticks(pid)
        except (OSError, ValueError, IndexError):
            ticks = 0
        self._started(Hosted(call_id, directory, spec, pid, dict(stdio.outputs)), ticks)
        self._refill_later(spec)

    def _started(self, command: Hosted, ticks: int) -> None:
        """Tend a command that runs and answer `spawned` with its pipes."""
        self.commands[command.call_id] = command
        try:
            command.pidfd = os.pidfd_open(command.pid)
            self.selector.register(command.pidfd, selectors.EVENT_READ, lambda _m, c=command: self._reap(c))
        except OSError:
            command.pidfd = None  # a kernel before 5.3: polled (REAP_POLL_S)
        self._send(
            {"op": "spawned", "id": command.call_id, "pid": command.pid, "start_ticks": ticks},
            [command.outputs["stdout"], command.outputs["stderr"]],
        )

    def _forget(self, call_id: str) -> None:
        command = self.commands.get(call_id)
        if command is None:
            return
        command.done = True
        for fd in command.outputs.values():
            os.close(fd)
        command.outputs.clear()
        if command.status is not None:
            self._drop(command)
        # Else it still runs (a call the daemon abandoned): reaped when it exits, then dropped.

    def _drop(self, command: Hosted) -> None:
        self.commands.pop(command.call_id, None)
        if command.pidfd is not None:
            self.selector.unregister(command.pidfd)
            os.close(command.pidfd)
            command.pidfd = None
        for name, fd in list(command.outputs.items()):
            if self.daemon is None:
                self.selector.unregister(fd)
            os.close(fd)
            del command.outputs[name]

    # -- exits --

    def _reap(self, command: Hosted) -> None:
        try:
            pid, status = os.waitpid(command.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = command.pid, 255 << 8
        if pid == 0:
            return
        command.status = status
        command.exited_at = time.monotonic()
        if command.pidfd is not None:
            self.selector.unregister(command.pidfd)
            os.close(command.pidfd)
            command.pidfd = None
        if command.done:
            self._drop(command)  # the daemon said done before the exit (an abandoned call)
        elif self.daemon is not None:
            self._send({"op": "exited", "id": command.call_id, "status": status})
        else:
            self._record_if_done(command)

    # -- the takeover, once the daemon is gone --

    def _take_over(self) -> None:
        assert self.daemon is not None
        self.pool.clear()
        self.pending_refill = None
        self.selector.unregister(self.daemon)
        self.daemon.close()
        self.daemon = None
        for command in list(self.commands.values()):
            if not command.outputs and command.status is not None:
                self._drop(command)
                continue
            if not command.outputs:
                continue  # done, still running: reaped and dropped when it exits
            for name, fd in command.outputs.items():
                command.writers[name] = SpoolWriter.resume(
                    command.directory / name, command.spec.spool_max_bytes, truncated=name in command.truncated
                )
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, lambda _m, c=command, n=name: self._on_output(c, n))
            if command.status is not None:
                self._record_if_done(command)

    def _on_output(self, command: Hosted, name: Stream) -> None:
        fd = command.outputs[name]
        try:
            data = os.read(fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            command.writers[name].write(data)
            return
        self.selector.unregister(fd)
        os.close(fd)
        del command.outputs[name]
        command.writers[name].close()
        self._record_if_done(command)

    def _timers(self) -> None:
        now = time.monotonic()
        for command in list(self.commands.values()):
            if command.status is None and command.timeout_at is not None and now >= command.timeout_at:
                command.timeout_at = None
                command.timed_out = True
                self._signal(command, signal.SIGTERM)
                command.kill_at = now + command.spec.kill_grace_s
            if command.kill_at is not None and now >= command.kill_at:
                command.kill_at = None
                self._signal(command, signal.SIGKILL)
            if command.exited_at is not None and now >= command.exited_at + COMPLETION_GRACE_S:
                self._record(command)

    def _signal(self, command: Hosted, signum: int) -> None:
        try:
            os.killpg(command.pid, signum)
        except OSError:
            pass
        if command.spec.cgroup is not None and signum == signal.SIGKILL:
            try:
                with open(os.path.join(command.spec.cgroup, "cgroup.kill"), "w") as handle:
                    handle.write("1")
            except OSError:
                pass  # cgroup v1, or gone: the group's SIGKILL above is what there is

    def _record_if_done(self, command: Hosted) -> None:
        if command.status is not None and not command.outputs:
            self._record(command)

    def _record(self, command: Hosted) -> None:
        """exit.json for a command the daemon left: how it ended, as its result says it."""
        if command.recorded or command.status is None:
            return
        command.recorded = True
        for writer in command.writers.values():
            writer.close()
        code = os.waitstatus_to_exitcode(command.status)
        exit_code, signame = (None, holder._signal_name(-code)) if code < 0 else (code, None)
        assert command.exited_at is not None
        duration = command.exited_at - command.started
        # The daemon times a command out while it lives (the host only after): a signal death
        # at or past the timeout is the daemon's timeout, had it lived to report it.
        timeout = command.spec.timeout_s
        timed_out = command.timed_out or (signame is not None and timeout is not None and duration >= timeout)
        record = ExitRecord(
            exit_code=exit_code,
            signal=signame,
            timed_out=timed_out,
            oom_killed=None,
            duration_ms=int(duration * 1000),
            ended_at=holder._now_iso(),
        )
        try:
            write_json_atomic(command.directory / EXIT_FILE, record.to_json(), durable=True)
        except OSError:
            pass  # the next daemon reports it interrupted, as without a host
        self._drop(command)


def main() -> int:
    # Out of the daemon's way: a signal to its group or a Ctrl-C in its terminal misses the
    # host, and the standard descriptors other than the socket go to /dev/null.
    daemon = socket.socket(fileno=os.dup(DAEMON_FD))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)
    os.chdir("/")
    # The host is in a session of its own (no terminal's or group's signal reaches it), and
    # everything it starts, pre-started shells included, inherits these.
    holder.restore_inherited_signals()
    Host(daemon).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
