"""Small durable-filesystem helpers shared by every writer that renames into place."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# What says the file system has no room. sqlite: SQLITE_FULL for a write (its unix VFS maps
# ENOSPC to it), SQLITE_IOERR_SHMSIZE when the -shm index of a WAL database cannot be grown,
# which is what opening or even reading the database on a full disk fails with. The OS:
# ENOSPC, or EDQUOT for a quota.
_FULL_SQLITE_ERRORS = frozenset({"SQLITE_FULL", "SQLITE_IOERR_SHMSIZE"})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` (an OSError or a sqlite3.Error) says the disk is full: a passing fault,
    never evidence that the state is damaged."""
    return getattr(exc, "sqlite_errorname", None) in _FULL_SQLITE_ERRORS or getattr(exc, "errno", None) in _FULL_ERRNOS


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries: a rename (or a new file) is durable only once the
    directory itself is on disk, not just the file's data."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
