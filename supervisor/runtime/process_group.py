"""A command's process group, from spawn to the moment the daemon may forget it (docs/protocol.md §7.4.1, §10).

Each command runs in a new session and process group, so a signal, a timeout or a stop
reaches every descendant, background jobs included. With a cgroup (runtime/cgroups.py) the
command is also in a cgroup of its own, which no descendant can leave (`setsid` leaves the
group, not the cgroup): signals then go to every member of the cgroup, the final kill is the
cgroup's (`cgroup.kill`, or freeze and kill in v1), and the group is alive while the cgroup is
populated. `ProcessGroup` is that group's lifecycle: spawn (through the command host,
command_host.py, which is the command's parent), wait, time out (SIGTERM to the group, SIGKILL
to whatever is left after the grace), abandon (SIGKILL and a bounded reap), signal. `LingeringGroups` watches
the groups that outlive their call (background descendants) and hands each back once it is
empty, with one /proc scan for all of them.

Nothing here journals, spools or counts: the shell runtime decides when each step happens and
what it means for the call. /proc is read through `processes`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import structlog
import trio

from sandbox_supervisor.protocol.fields import Stream
from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.cgroups import CommandCgroup
from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost, HostedProcess, HostLost
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec

__all__ = [
    "ABANDON_REAP_TIMEOUT_S",
    "GROUP_POLL_S",
    "LINGER_POLL_S",
    "LeaderExit",
    "LingeringGroups",
    "ProcessGroup",
]

log = structlog.get_logger("supervisor.shell")

# How often a terminating group is checked for survivors (each check scans /proc).
GROUP_POLL_S = 0.05
# How often a completed command's lingering group (background descendants) is checked for
# being empty; each check scans /proc, and the daemon forgets the group after the first
# empty one.
LINGER_POLL_S = 1.0
# Reaping a SIGKILLed shell whose call was abandoned; shielded, so bounded.
ABANDON_REAP_TIMEOUT_S = 1.0


class LeaderExit(NamedTuple):
    returncode: int  # Popen-style: negative when a signal ended it
    timed_out: bool  # the timeout fired and the group was terminated


def signal_group(cgroup: CommandCgroup | None, pgid: int, signum: int) -> bool:
    """Signal a command: every member of its cgroup when it has one (which holds the group
    and whatever left it with setsid), else its process group. False when none is left."""
    if cgroup is not None:
        try:
            return cgroup.signal(signum) > 0
        except OSError:
            pass  # the cgroup unreadable (removed under us): the group is what is known
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        # PermissionError: the pgid was reused by someone else's process; not ours.
        return False


class ProcessGroup:
    """A spawned process leading its own session and process group (pgid == its pid)."""

    def __init__(self, process: HostedProcess, cgroup: CommandCgroup | None = None) -> None:
        self.process = process
        # start_new_session: the process leads its own session and group.
        self.pgid = process.pid
        # The command's own cgroup, which it was placed in before it exec'd (None: process
        # groups alone).
        self.cgroup = cgroup

    @classmethod
    async def hosted(
        cls,
        host: CommandHost,
        call_id: str,
        directory: Path,
        spec: HolderSpec,
        cgroup: CommandCgroup | None = None,
        place: Sequence[Sequence[str]] = (),
    ) -> ProcessGroup:
        """Start `spec` through the command host (command_host.py), which is the command's
        parent, so that its exit status and output outlive the daemon. The host's child puts
        itself in the cgroup (spec.cgroup, as root, before the switch of ids) and sets its
        OOM score before it execs: nothing of the command runs outside its cgroup or with the
        daemon's protection. `place`: cgroups (as `CommandCgroup.joined_in_order`) for the
        host's next idle shells (ready_cgroups.py). SpawnFailed (command_host_link.py) when
        it did not start."""
        return cls(await host.spawn(call_id, directory, spec, place), cgroup)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The leader's Popen-style return code (negative: killed by that signal), None while
        it runs. The group may live on after it: see `alive`."""
        return self.process.returncode

    def pipes(self) -> dict[Stream, trio.abc.ReceiveStream]:
        """The leader's stdout and stderr pipes (which descendants share)."""
        stdout, stderr = self.process.stdout, self.process.stderr
        # spawn() always asks for both pipes; a ProcessGroup built otherwise has none to read.
        if stdout is None or stderr is None:
            raise ValueError("the process was not started with stdout and stderr pipes")
        return {"stdout": stdout, "stderr": stderr}

    def start_ticks(self) -> int | None:
        """The leader's start time (clock ticks since boot): with the pid it identifies the
        group across a daemon restart (processes.kill_leftover_group). The host read it
        before it answered the spawn, while the process could not have been reaped (it is
        the parent); read here only when the host could not (None once reaped)."""
        return self.process.start_ticks or processes.start_ticks(self.pid)

    def send_signal(self, signum: int) -> bool:
        """Signal the whole group — with a cgroup, every member of the cgroup, which holds
        the group and whatever left it with setsid. False when no process of it is left."""
        return signal_group(self.cgroup, self.pgid, signum)

    def kill(self) -> None:
        """SIGKILL everything: by the cgroup (race-free) when there is one, else the group."""
        if self.cgroup is not None:
            try:
                self.cgroup.kill()
                return
            except OSError:
                pass
        self.send_signal(signal.SIGKILL)

    def alive(self) -> bool:
        """True while any non-zombie process remains in the group — with a cgroup, while
        the cgroup is populated."""
        if self.cgroup is not None:
            try:
                return self.cgroup.populated()
            except OSError:
                pass
        return processes.group_alive(self.pgid)

    def oom_killed(self) -> bool:
        """The cgroup's memory limit OOM-killed a process of the command."""
        return self.cgroup is not None and self.cgroup.oom_kills() > 0

    async def wait(self) -> int:
        """Wait for the leader to exit (and reap it); its return code."""
        return await self.process.wait()

    async def wait_or_terminate(self, timeout_s: float, grace_s: float) -> LeaderExit:
        """Wait for the leader to exit; past `timeout_s` terminate the group (see `terminate`)
        and wait for the leader then."""
        with trio.move_on_after(timeout_s):
            await self.process.wait()
        timed_out = self.returncode is None
        if timed_out:
            await self.terminate(grace_s)
        return LeaderExit(await self.process.wait(), timed_out)

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left after the grace —
        descendants that ignore SIGTERM included."""
        self.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace_s):
            while self.alive():
                await trio.sleep(GROUP_POLL_S)
        if self.cgroup is not None:
            # A v1 freeze waits for the tasks to stop: off the trio loop.
            await trio.to_thread.run_sync(self.kill)
        else:
            self.send_signal(signal.SIGKILL)

    async def abandon(self) -> None:
        """SIGKILL the group and reap the leader, waiting at most ABANDON_REAP_TIMEOUT_S even
        inside a cancelled scope: for a call that is cancelled or failed, so that no group is
        left running that nobody tends."""
        self.kill()
        with trio.move_on_after(ABANDON_REAP_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                await self.process.wait()
            except HostLost:
                pass  # its parent, the command host, is gone: nothing is left to reap


class LingeringGroups:
    """Groups whose call is over but in which background descendants still run.

    Each is handed back (its `on_empty` called) once no process is left in it. One task,
    started with the first group and ending with the last, checks all of them with one /proc
    scan (in a worker thread) per `poll_s`, however many there are.

    A number stays reserved while any process uses it as a process group id, so the pgid is
    safe to signal until the group empties; watching keeps the time after that (when the
    number may be reused for an unrelated process, which a stop or a restart must never
    signal) down to one poll.
    """

    def __init__(self, nursery: trio.Nursery, poll_s: float = LINGER_POLL_S) -> None:
        self._nursery = nursery
        self._poll_s = poll_s
        self._groups: dict[ProcessGroup, Callable[[], None]] = {}
        self._sweeping = False

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def watch(self, group: ProcessGroup, on_empty: Callable[[], None]) -> None:
        self._groups[group] = on_empty
        if not self._sweeping:
            self._sweeping = True
            self._nursery.start_soon(self._sweep)

    def discard(self, group: ProcessGroup) -> None:
        self._groups.pop(group, None)

    async def _sweep(self) -> None:
        try:
            while self._groups:
                await trio.sleep(self._poll_s)
                # Only groups that were lingering before the scan began can be judged by it:
                # one added while the thread reads /proc may be missing from the listing.
                candidates = list(self._groups)
                try:
                    live = await trio.to_thread.run_sync(processes.live_groups)
                except OSError as exc:  # /proc unreadable for a moment (EMFILE …): next poll
                    log.warning("process.scan_failed", error=exc.strerror)
                    continue
                for group in candidates:
                    # The scan is not atomic (a member may fork and exit while it runs), so
                    # an absent group is confirmed with killpg(pgid, 0), which is cheap when
                    # the group is gone (ESRCH), a closer look only when it is not.
                    if group.pgid not in live and group in self._groups and not group.alive():
                        self._groups.pop(group)()
        finally:
            self._sweeping = False
