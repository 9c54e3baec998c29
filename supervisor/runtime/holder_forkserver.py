"""A fork server for holders: one warm interpreter that starts a holder per request.

`launch_holder` (holder_launch.py) starts each holder as a new interpreter: about 40 ms, most
of a process's start. This program pays that once: the daemon starts it at its own start
(`python -I -m sandbox_supervisor.daemon.runtime.holder_forkserver`, stdin and stdout on two
pipes), then writes one line per holder, the holder's directory (whose spec.json it wrote
first), and reads one line back, `<status> <directory>`: 0 once holder.json is written, else
the starter's failure status (holder.json then says why, or nothing was written).

Each request forks a starter, which leaves the server's session (setsid), puts /dev/null on
its standard descriptors (the pipes to the daemon must not reach a holder, or the daemon's
death would not close them) and does what `python -m …holder <dir>` does: it forks the
holder and exits once holder.json exists. The server reaps the starter, so the holder is no
one's child here: reparented at once, it outlives the server and the daemon alike.

Requests are served one at a time (a start takes a few milliseconds here). The server ends
when its stdin closes: a daemon that dies leaves no server behind, and the next one starts
its own. Standard library only, like the holder it forks (holder.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sandbox_supervisor.daemon.runtime import holder

# Reported when the starter could not even be forked (no memory, a process limit).
FORK_FAILED_STATUS = 71  # EX_OSERR


def start_one(directory: Path) -> int:
    """Fork a starter for the holder of `directory`; its exit status (0: holder.json written)."""
    try:
        pid = os.fork()
    except OSError:
        return FORK_FAILED_STATUS
    if pid == 0:
        status = 1
        try:
            os.setsid()  # out of the server's session and group: a signal to them misses it
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            if devnull > 2:
                os.close(devnull)
            os.chdir("/")
            status = holder.main([str(directory)])
        except BaseException:  # noqa: BLE001 - whatever happens, this fork must not return
            status = 1
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status)


def serve() -> int:
    """Answer each directory line with `<status> <directory>` until stdin closes."""
    source = sys.stdin.buffer
    sink = sys.stdout.buffer
    for raw in source:
        line = raw.rstrip(b"\n")
        if not line:
            continue
        directory = Path(os.fsdecode(line))
        status = start_one(directory)
        sink.write(b"%d %s\n" % (status, line))
        sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
