"""Process-group facts from /proc, and the clean-up of groups a crashed daemon left behind.

A pid alone is not an identity: after a crash and a restart the pid may belong to someone
else. A process is "ours" when its start time (field 22 of /proc/PID/stat, in clock ticks
since boot) equals the one recorded at spawn, or — for descendants of a shell that already
exited — when it still sits in the session the shell created (sid == pgid == shell pid) and
started no earlier than the shell did.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# Scan-and-kill passes over a leftover group at start (each pass scans /proc).
LEFTOVER_KILL_ROUNDS = 50


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start_ticks: int


def parse_stat(text: str) -> ProcStat | None:
    """Parse /proc/PID/stat. The command name (field 2) may contain spaces and parentheses,
    so fields are counted from the last ')'."""
    head, sep, tail = text.rpartition(")")
    if not sep:
        return None
    fields = tail.split()
    try:
        pid = int(head.split("(", 1)[0])
        # tail starts at field 3 (state): index = field number - 3
        return ProcStat(
            pid=pid,
            state=fields[0],
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            session=int(fields[3]),
            start_ticks=int(fields[19]),
        )
    except (ValueError, IndexError):
        return None


# Errors that say this process or the machine is short of something (descriptors, kernel
# memory) rather than anything about the process asked for: a scan that meets one has not
# seen every process, so it must not be read as "no process".
EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def read_stat(pid: int) -> ProcStat | None:
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except OSError:
        return None


def _scan_stat(pid: int) -> ProcStat | None:
    """read_stat for a scan of /proc: None when the process is gone (or unreadable), but a
    shortage (EXHAUSTION_ERRNOS) is raised, so the scan fails rather than miss a member."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except OSError as exc:
        if exc.errno in EXHAUSTION_ERRNOS:
            raise
        return None


def start_ticks(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.start_ticks if stat else None


def group_members(pgid: int) -> list[ProcStat]:
    """Live (non-zombie) processes whose process group is `pgid` (OSError when /proc cannot
    be listed). A member whose stat cannot be read is left out, as kill_leftover_group's
    callers have always had it; group_alive scans with _scan_stat, which fails instead."""
    return _members(pgid, read_stat)


def _members(pgid: int, read: Callable[[int], ProcStat | None]) -> list[ProcStat]:
    members = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = read(int(entry.name))
            if stat is not None and stat.pgrp == pgid and stat.state != "Z":
                members.append(stat)
    return members


def live_groups() -> set[int]:
    """The process group ids that have a live (non-zombie) member: one scan of /proc, for
    checking many groups at once. OSError when /proc cannot be read whole."""
    groups = set()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _scan_stat(int(entry.name))
            if stat is not None and stat.state != "Z":
                groups.add(stat.pgrp)
    return groups


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process remains in the group.

    Never raises: when /proc cannot be read (the daemon is out of descriptors, say) the
    answer is True, the group exists after all (killpg found it). That is the safe side:
    "alive" makes a caller wait, signal the group again (harmless: the number stays the
    group's while any process, zombies included, uses it) or keep watching it until a later
    check can read /proc, whereas a wrong "gone" would forget a group that still runs. An
    exception here would end the task that asked, and with it the daemon."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        # PermissionError: the pgid now belongs to another user's processes, not ours.
        return False
    # killpg(…, 0) also succeeds for zombies that nobody has reaped yet: look closer, with
    # a scan that fails rather than miss a member it could not read.
    try:
        return bool(_members(pgid, _scan_stat))
    except OSError:
        return True


def ours(stat: ProcStat, pgid: int, recorded_start: int) -> bool:
    if stat.pid == pgid:
        return stat.start_ticks == recorded_start
    return stat.session == pgid and stat.pgrp == pgid and stat.start_ticks >= recorded_start


def kill_leftover_group(pid: int, pgid: int, recorded_start: int) -> int:
    """SIGKILL the processes of a group a previous instance started, if they are still the
    same processes. Returns how many were killed.

    One scan is not enough: a member that forks between the scan and its SIGKILL leaves a
    child the scan never saw (a fork loop leaves dozens). Scans repeat until one finds
    nothing of ours, up to LEFTOVER_KILL_ROUNDS.

    When another process holds the recorded pid (its start time differs), nothing in the
    group is ours: the kernel reuses a number only once no process uses it as a pid, group
    or session id, so every process of our group was gone before that one started. Its
    own group must then be left alone, children included."""
    leader = read_stat(pid)
    if leader is not None and leader.start_ticks != recorded_start:
        return 0
    killed = 0
    for _ in range(LEFTOVER_KILL_ROUNDS):
        found = [stat for stat in group_members(pgid) if ours(stat, pgid, recorded_start)]
        if not found:
            break
        for stat in found:
            try:
                os.kill(stat.pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
