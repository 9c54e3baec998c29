"""Spool directories made ahead of need.

A command's spool directory (`<state_dir>/spool/<call_id>`) is made on the call's path,
before its spawn. A mkdir is a metadata write of the file system: on ext4 it costs 0.1-0.7 ms
(about 160 µs on the benchmark machine), on the event loop, while a rename of an empty
directory costs about 30 µs. So the shell runtime keeps a few empty directories in
`<state_dir>/spool-ready/`, made by a worker thread between calls, and a call's directory is
one of them renamed into place. Nothing else changes: the directory exists from the same
moment, with the same mode, on the same file system; when none is ready (the first call, a
burst, a full disk) the call makes its own, as before.

`spool-ready/` holds only empty directories of this daemon's own making: the next start
takes the ones it finds, and a state directory moved away by `reset-state` takes them along.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import structlog
import trio

from sandbox_supervisor.daemon.runtime.spool import SPOOL_DIRECTORY, SPOOL_DIRECTORY_MODE, spool_dir

log = structlog.get_logger("supervisor.spool")

READY_DIRECTORY = "spool-ready"
# How many are kept ready, and below how many the worker makes more: enough for a burst of
# calls between two refills, few enough that a sandbox that runs no command holds almost none.
READY_TARGET = 8
READY_LOW = 2
# A call's directory that exists already (a reused call_id; the spool writers then refuse it
# as before), or a file put at its path from outside, fails the rename with one of these,
# and the ready directory stays ready.
_TARGET_EXISTS = frozenset({errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR})


class ReadySpoolDirectories:
    """Empty directories to rename into `spool/<call_id>`; `take` on the call's path, the
    refill in a worker thread, started from the runtime's nursery."""

    def __init__(self, state_dir: Path, nursery: trio.Nursery, target: int = READY_TARGET) -> None:
        self._state_dir = state_dir
        self._ready = state_dir / READY_DIRECTORY
        self._nursery = nursery
        self._target = target
        self._names = _existing(self._ready)
        self._refilling = False

    @property
    def ready(self) -> int:
        return len(self._names)

    def take(self, call_id: str) -> bool:
        """Make the call's spool directory by renaming a ready one; False when none is ready
        or the rename failed (the caller then makes the directory itself). Starts a refill
        when few are left."""
        taken = False
        while self._names and not taken:
            name = self._names.pop()
            try:
                os.rename(self._ready / name, spool_dir(self._state_dir, call_id))
                taken = True
            except OSError as exc:
                if exc.errno in _TARGET_EXISTS:
                    self._names.append(name)  # still ready; the call's own directory is in the way
                    break
                # Gone from outside, or the file system refused: that one is not used again.
        if len(self._names) < READY_LOW and not self._refilling:
            self._refilling = True
            try:
                self._nursery.start_soon(self._refill)
            except RuntimeError:  # the nursery is closing (a stop): none are needed any more
                self._refilling = False
        return taken

    async def _refill(self) -> None:
        try:
            made = await trio.to_thread.run_sync(self._make, self._target - len(self._names))
            self._names.extend(made)
        finally:
            self._refilling = False

    def _make(self, count: int) -> list[str]:
        """`count` new empty directories (fewer when the file system refuses: the calls then
        make their own, and the refusal is theirs to report)."""
        made: list[str] = []
        try:
            # The spool itself too: a rename needs its target's parent.
            os.makedirs(self._state_dir / SPOOL_DIRECTORY, mode=SPOOL_DIRECTORY_MODE, exist_ok=True)
            os.makedirs(self._ready, mode=SPOOL_DIRECTORY_MODE, exist_ok=True)
            for _ in range(count):
                name = uuid.uuid4().hex
                os.mkdir(self._ready / name, SPOOL_DIRECTORY_MODE)
                made.append(name)
        except OSError as exc:
            log.info("spool.ready_directories_refused", error=exc.strerror or str(exc), made=len(made))
        return made


def _existing(ready: Path) -> list[str]:
    """The empty directories a previous run left ready (anything else there is left alone)."""
    names: list[str] = []
    try:
        with os.scandir(ready) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and not os.listdir(entry.path):
                    names.append(entry.name)
    except OSError:
        pass
    return names
