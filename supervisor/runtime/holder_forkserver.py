"""A fork server for holders: one warm interpreter that starts a holder per request.

`launch_holder` (holder_launch.py) starts each holder as a new interpreter: about 40 ms, most
of a process's start. This program pays that once: the daemon starts it at its own start
(`python -I -m sandbox_supervisor.daemon.runtime.holder_forkserver`, stdin and stdout on two
pipes), then writes one line per holder, the holder's directory (whose spec.json it wrote
first), and reads one line back, `<status> <directory>`: 0 once holder.json is written, else
the starter's failure status (holder.json then says why, or nothing was written).

Each holder is forked *ahead* of its request, as a spare: it leaves the server's session
(setsid), puts /dev/null on its standard descriptors (the pipes to the daemon must not reach a
holder, or the daemon's death would not close them), gives the signals their defaults back,
runs a holder's start on nothing (`holder.warm_up`: the pages a start writes are copied now,
not while a start waits), and waits on a pipe of its own for a directory. The request hands it
one; it then does what `python -m …holder <dir>` does once forked: it writes holder.json and
closes a pipe the server waits on. The server forks the next spare SPARE_DELAY_S after
answering (a request that comes sooner gets a fresh fork), off the next start's path and out of
the way of the tail of the start it answered: a start no longer waits for a fork of this
process and for the faults of its first instructions (the copies of the pages it writes), about
2 ms of the 5–6 ms from request to holder.json on this machine (bench/README.md). A spare that
has died meanwhile is replaced before its request is handed over (the request reaches a live
spare or a fresh fork, never nobody); once the server ends, its spare reads the end of its pipe
and exits without starting anything.

Each holder starts its process as the command host starts a command (`spawner.Spawner`: Popen:
a vfork, or with a command user a fork with a C child, and no Python code before exec; the
cgroup and OOM score set on the holder around it), not by `holder.spawn`'s fork running Python
code in the child: about 1.5 ms less per start. The way back from a command's cgroups is proven
by the server just before it forks the next spare (`Spawner.prepare`), so the spares forked
later inherit it.

The server ignores SIGCHLD, so the kernel reaps each holder as it ends and none is a zombie
meanwhile; once the server ends, its holders are reparented and outlive it and the daemon
alike. One fork per holder, not a starter that forks it (about 1.5 ms less per start, measured
with `true`: 7.2 → 5.7 ms from the request to holder.json).

Requests are served one at a time (a start takes a few milliseconds here). The server ends
when its stdin closes: a daemon that dies leaves no server behind, and the next one starts
its own. Standard library only, like the holder it forks (holder.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

from sandbox_supervisor.daemon.runtime import holder
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    HOLDER_FILE,
    SPEC_FILE,
    HolderProtocolError,
    LineSplitter,
    parse_spec,
)
from sandbox_supervisor.daemon.runtime.spawner import Spawner

# Reported when no holder could be forked (no memory, a process limit).
FORK_FAILED_STATUS = 71  # EX_OSERR
# The longest directory line a spare reads (a path, well under PATH_MAX).
MAX_REQUEST_BYTES = 8192
# After an answer, how long the server waits before it forks the next spare (and learns the
# spec's cgroups), unless a request comes first (that one gets a fresh fork). The start just
# answered still has its tail to run on the same cores: the daemon journals it and connects,
# the holder answers, the process prints its first output; a fork of this interpreter at once
# delays that output. Too long a wait and a quick next start finds no spare. process_start,
# alternated runs (the ratio): at once 4.02, 4.55, 4.67x; 3 ms 3.88, 4.12, 4.20x; 5 ms 3.51,
# 3.83, 4.40x; in another series 3 ms 2.96, 3.13, 3.63x, 10 ms 3.30, 3.81, 3.67x, 20 ms 3.88,
# 4.08, 4.02x. Waiting at all, and not too long, is what shows; between 3 and 10 ms the
# differences are within this machine's noise.
SPARE_DELAY_S = 0.005
REQUEST_FD = 0  # stdin: the daemon's directory lines
ANSWER_FD = 1  # stdout: the answers
READ_CHUNK_BYTES = 4096


class Spare(NamedTuple):
    """A holder forked ahead of its request."""

    pid: int
    request: int  # write end: the directory, one line
    ready: int  # read end: closed by the holder once holder.json is written, or by its end


def fork_spare(spawner: Spawner) -> Spare | None:
    """Fork a holder that waits for its directory; None when no fork can be made now."""
    request_r, request_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (request_r, request_w, ready_r, ready_w):
            os.close(fd)
        return None
    if pid == 0:
        status = 1
        try:
            os.close(request_w)
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
            holder.prepare_process()
            holder.warm_up()
            line = _read_request(request_r)
            os.close(request_r)
            if line is None:
                status = 0  # the server ended (or replaced this spare): nothing to start
            else:
                status = holder.run_holder(Path(os.fsdecode(line)), ready_w, spawner.spawn, prepared=True)
        except BaseException:  # noqa: BLE001 - whatever happens, this fork must not return
            status = 1
        os._exit(status)
    os.close(request_r)
    os.close(ready_w)
    return Spare(pid, request_w, ready_r)


def _read_request(fd: int) -> bytes | None:
    """The spare's directory line; None at the end of the pipe without a whole line."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, MAX_REQUEST_BYTES)
        if not chunk or len(data) + len(chunk) > MAX_REQUEST_BYTES:
            return None
        data += chunk
    return data[:-1]


def discard(spare: Spare) -> None:
    """Close the server's ends: a spare still waiting reads the end and exits."""
    for fd in (spare.request, spare.ready):
        try:
            os.close(fd)
        except OSError:
            pass


def hand_over(spare: Spare, directory: Path) -> int | None:
    """Give `spare` its directory; 0 once its holder.json is written, else 1 (holder.json
    then says why, or nothing was written). None when the spare had died before it could be
    told (its pipe is broken): nothing of this request ran."""
    try:
        # One write into an empty pipe; the spare reads up to the newline, so a path longer
        # than PIPE_BUF arrives whole too. MAX_REQUEST_BYTES bounds it (serve's splitter).
        os.write(spare.request, os.fsencode(directory) + b"\n")
    except BrokenPipeError:
        discard(spare)
        return None
    os.close(spare.request)
    try:
        # Closed by the holder once holder.json is written, or by its end.
        while os.read(spare.ready, 1):
            pass
    finally:
        os.close(spare.ready)
    return 0 if (directory / HOLDER_FILE).exists() else 1


def start_one(directory: Path, spare: Spare | None, spawner: Spawner) -> int:
    """Start the holder of `directory` by `spare`, or by a fresh fork when there is none or
    it has died; the status to answer."""
    for _ in range(2):  # the spare, then (if it was dead) one fresh fork
        if spare is None:
            spare = fork_spare(spawner)
            if spare is None:
                return FORK_FAILED_STATUS
        status = hand_over(spare, directory)
        if status is not None:
            return status
        spare = None
    return FORK_FAILED_STATUS


def learn_from(directory: Path, spawner: Spawner) -> None:
    """Prove the way back from the cgroups of the spec just started, for the spares forked
    from now on (`Spawner.prepare`); a spec that cannot be read is the holder's to report."""
    try:
        spec = parse_spec(json.loads((directory / SPEC_FILE).read_text(encoding="utf-8")))
        spawner.prepare(spec)
    except Exception:  # noqa: BLE001 - best effort: the next holder then proves it itself
        return


def serve() -> int:
    """Answer each directory line with `<status> <directory>` until stdin closes."""
    # Holders are this process's children until it ends; the kernel reaps them, so none
    # stays a zombie while the server runs.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    spawner = Spawner()
    spare = fork_spare(spawner)
    # When to fork the next spare: None while there is one, before the first request, or
    # after a fork that failed (the next request then forks its own).
    spare_due: float | None = None
    answered: Path | None = None  # a start whose cgroups are to be learnt (until one is)
    lines = LineSplitter(MAX_REQUEST_BYTES)
    ready: list[bytes] = []
    try:
        while True:
            if not ready:
                timeout = None if spare_due is None else max(0.0, spare_due - time.monotonic())
                if not select.select([REQUEST_FD], [], [], timeout)[0]:
                    # Quiet since the last answer: learn its cgroups, then fork the spare,
                    # which inherits what was learnt.
                    if answered is not None:
                        learn_from(answered, spawner)
                        answered = None
                    spare, spare_due = fork_spare(spawner), None
                    continue
                data = os.read(REQUEST_FD, READ_CHUNK_BYTES)
                if not data:
                    return 0  # the daemon closed our stdin (or died)
                ready.extend(line for line in lines.feed(data) if line)
                continue
            line = ready.pop(0)
            directory = Path(os.fsdecode(line))
            status = start_one(directory, spare, spawner)
            spare = None
            try:
                _write_all(ANSWER_FD, b"%d %s\n" % (status, line))
            except BrokenPipeError:
                return 0  # the daemon died waiting: the holder runs on, as after any start
            # A daemon's cgroup hierarchies are fixed for its life (and the server's): once
            # one spec's way back is proven, later specs have nothing new to teach.
            if not spawner.homes:
                answered = directory
            spare_due = time.monotonic() + SPARE_DELAY_S
    except HolderProtocolError:
        return 1  # a request line over the limit: the daemon's side is broken
    finally:
        if spare is not None:
            discard(spare)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (a pipe may take part of a long line)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


if __name__ == "__main__":
    sys.exit(serve())
