"""Small durable-filesystem helpers shared by every writer that renames into place."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries: a rename (or a new file) is durable only once the
    directory itself is on disk, not just the file's data."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
