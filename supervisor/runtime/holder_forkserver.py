"""A fork server for holders: one warm interpreter that starts a holder per request.

`launch_holder` (holder_launch.py) starts each holder as a new interpreter: about 40 ms, most
of a process's start. This program pays that once: the daemon starts it at its own start
(`python -I -m sandbox_supervisor.daemon.runtime.holder_forkserver`, stdin and stdout on two
pipes), then writes one line per holder, the holder's directory (whose spec.json it wrote
first), and reads one line back, `<status> <directory>`: 0 once holder.json is written, else
the starter's failure status (holder.json then says why, or nothing was written).

Each request forks the holder itself, which leaves the server's session (setsid), puts
/dev/null on its standard descriptors (the pipes to the daemon must not reach a holder, or
the daemon's death would not close them) and does what `python -m …holder <dir>` does once
forked: it writes holder.json and closes a pipe the server waits on. The server ignores
SIGCHLD, so the kernel reaps each holder as it ends and none is a zombie meanwhile; once the
server ends, its holders are reparented and outlive it and the daemon alike. One fork per
holder, not a starter that forks it (about 1.5 ms less per start, measured with `true`:
7.2 → 5.7 ms from the request to holder.json).

Requests are served one at a time (a start takes a few milliseconds here). The server ends
when its stdin closes: a daemon that dies leaves no server behind, and the next one starts
its own. Standard library only, like the holder it forks (holder.py).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from sandbox_supervisor.daemon.runtime import holder
from sandbox_supervisor.daemon.runtime.holder_protocol import HOLDER_FILE

# Reported when the starter could not even be forked (no memory, a process limit).
FORK_FAILED_STATUS = 71  # EX_OSERR


def start_one(directory: Path) -> int:
    """Fork the holder of `directory`; 0 once its holder.json is written, else 1 (holder.json
    then says why, or nothing was written), or FORK_FAILED_STATUS."""
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(ready_r)
        os.close(ready_w)
        return FORK_FAILED_STATUS
    if pid == 0:
        status = 1
        try:
            os.close(ready_r)
            # The server ignores SIGCHLD (so the kernel reaps its holders); the holder waits
            # for its own process, which needs the default disposition back.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()  # out of the server's session and group: a signal to them misses it
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            if devnull > 2:
                os.close(devnull)
            status = holder.run_holder(directory, ready_w)
        except BaseException:  # noqa: BLE001 - whatever happens, this fork must not return
            status = 1
        os._exit(status)
    os.close(ready_w)
    try:
        # Closed by the holder once holder.json is written, or by its end.
        while os.read(ready_r, 1):
            pass
    finally:
        os.close(ready_r)
    return 0 if (directory / HOLDER_FILE).exists() else 1


def serve() -> int:
    """Answer each directory line with `<status> <directory>` until stdin closes."""
    # Holders are this process's children until it ends; the kernel reaps them, so none
    # stays a zombie while the server runs.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
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
