"""read_file (docs/protocol.md §7.3): a byte range of a jailed file, with the whole file's sha.

Decisions:
- `content` is text when the returned bytes are valid UTF-8, else base64. The decision is
  about the range alone, so a range that cuts a multi-byte character is base64 even in a
  text file; a client that pages text should decode the concatenated bytes, not each page.
- An `offset` at or past the end returns length 0 and `eof: true` (`offset` is echoed as
  sent). The original specification's `eof` was `offset + length == size` (docs/deltas.md
  item 19); past the end that sum is larger than `size`, and `eof` is read as
  `offset + length >= size`, so a pager always stops.
- The file is streamed once: the sha needs every byte, the content only the range, and a
  large file must not be held in memory. If the file's size or mtime changes while it is
  read, the read starts over (a few times), so `sha`, `size` and `content` describe one
  version.
- Bounded: a file over `[files] max_file_bytes` (fstat of the opened file) is
  `file_too_large` before a byte is read; otherwise exactly the size seen at open is read
  and hashed, never to end of file, so a file that keeps growing cannot keep a read going.
- A missing file is `not_found`; a directory (agent.cwd included) or a special file is
  `invalid_parameters`.
- The file is opened by the jail's descriptor walk (`paths.open_in_jail`), never by path: a
  retry after a change walks again from agent.cwd's descriptor.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO, Literal

from sandbox_supervisor.protocol.errors import FILE_TOO_LARGE, INTERNAL, INVALID_PARAMETERS, NOT_FOUND
from sandbox_supervisor.protocol.tools import ReadFileResult
from sandbox_supervisor.protocol.tools import MAX_READ_LENGTH, ReadFileParams
from sandbox_supervisor.daemon.runtime.failures import ToolFailure, os_failure
from sandbox_supervisor.daemon.runtime.paths import READ_FLAGS, JailedPath, open_path

__all__ = [
    "open_entry",
    "DEFAULT_MAX_FILE_BYTES",
    "Opener",
    "check_regular_file",
    "check_size",
    "open_regular_file",
    "read_file_result",
]

READ_CHUNK_BYTES = 1024 * 1024
# A file rewritten while we hash it is read again; a file that never holds still is an error.
# Each attempt reads at most the size seen when it opened the file (itself at most the
# configured maximum), so a file that keeps changing costs a bounded amount of work.
MAX_READ_ATTEMPTS = 3
# The default of `[files] max_file_bytes` (README, "Configuration"); direct callers (tests,
# tools) that do not pass the configured value get this bound, never none.
DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024

# Opens the file afresh through the jail (each read attempt calls it once).
Opener = Callable[[], AbstractContextManager[JailedPath]]


def open_entry(directory: int, name: str, swapped_message: str) -> int | None:
    """Open `name` in `directory` for reading, never through a symlink: its descriptor, None
    when it does not exist, ToolFailure(internal, `swapped_message`) when it is a symlink now
    (the agent swapped it since the walk judged it)."""
    try:
        return os.open(name, READ_FLAGS | os.O_NOFOLLOW, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ToolFailure(INTERNAL, swapped_message) from None


def read_file_result(
    target: Path | Opener,
    display_path: str,
    params: ReadFileParams,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    inline_max_bytes: int | None = None,
) -> dict[str, Any] | None:
    """The read_file result for `target` (an opener of the jailed file, or a path the caller
    vouches for); raises ToolFailure.

    With `inline_max_bytes` (the fast path on the trio thread), None when the opened file is
    larger than that, or changed while it was read: the caller goes on in a worker thread,
    so the trio thread never reads more than `inline_max_bytes` bytes, nor twice.
    """
    length = MAX_READ_LENGTH if params.length is None else params.length
    if isinstance(target, Path):
        path = target
        target = lambda: open_path(path, READ_FLAGS)  # noqa: E731
    for _ in range(MAX_READ_ATTEMPTS):
        try:
            read = _read_once(target, params.offset, length, max_file_bytes, inline_max_bytes)
        except OSError as exc:
            raise os_failure(exc, "read") from None
        if read is not None:
            break
        if inline_max_bytes is not None:
            return None
    else:
        raise ToolFailure(INTERNAL, "The file kept changing while it was read.")
    if read is _TOO_LARGE_FOR_INLINE:
        return None
    sha, size, chunk = read
    encoding: Literal["utf-8", "base64"]
    try:
        content, encoding = chunk.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        content, encoding = base64.b64encode(chunk).decode("ascii"), "base64"
    return ReadFileResult(
        path=display_path,
        sha=sha,
        size=size,
        offset=params.offset,
        length=len(chunk),
        encoding=encoding,
        content=content,
        eof=params.offset + len(chunk) >= size,
    ).model_dump()


def check_regular_file(mode: int) -> None:
    """Refuse a directory (agent.cwd included) or a special file; the file tools take files."""
    if stat.S_ISDIR(mode):
        raise ToolFailure(INVALID_PARAMETERS, "The path is a directory, not a file.")
    if not stat.S_ISREG(mode):
        # A fifo or device would block or never end.
        raise ToolFailure(INVALID_PARAMETERS, "The path is not a regular file.")


def open_regular_file(jailed: JailedPath, *, buffering: int = -1) -> tuple[BinaryIO, os.stat_result] | None:
    """The jailed file opened for reading, with its stat; None when nothing is there;
    ToolFailure for a directory or a special file; NotADirectoryError when a parent is not a
    directory (what that means depends on the tool). The walk opened it (READ_FLAGS:
    O_NONBLOCK, so a fifo cannot block; O_NOFOLLOW); a second call opens the same name in the
    same parent descriptor again, and a symlink swapped in meanwhile is refused, not followed."""
    if jailed.state == "missing":
        return None
    if jailed.state == "blocked":
        raise NotADirectoryError(errno.ENOTDIR, "A parent of the path is not a directory.")
    if jailed.fd is not None:
        fd = jailed.take_fd()
    else:
        opened = open_entry(jailed.parent_fd, jailed.name, "The file was replaced by a symlink while it was used; retry.")
        if opened is None:
            return None
        fd = opened
    try:
        info = os.fstat(fd)
        check_regular_file(info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    # fdopen refuses a directory's fd, hence the check above before it takes ownership.
    return os.fdopen(fd, "rb", buffering=buffering), info


def check_size(info: os.stat_result, max_file_bytes: int) -> None:
    """Refuse a file over the configured maximum, from the opened file's fstat: before a
    byte is read or hashed, so a huge (or sparse) file costs nothing."""
    if info.st_size > max_file_bytes:
        raise ToolFailure(
            FILE_TOO_LARGE,
            f"The file is {info.st_size} bytes; the limit is {max_file_bytes} bytes.",
            {"size": info.st_size, "max_bytes": max_file_bytes},
        )


# _read_once's answer (compared by identity) for a file the fast path leaves to a thread.
_TOO_LARGE_FOR_INLINE: tuple[str, int, bytes] = ("", -1, b"")


def _read_once(
    target: Opener, offset: int, length: int, max_file_bytes: int, inline_max_bytes: int | None
) -> tuple[str, int, bytes] | None:
    """(git blob sha, size, bytes of the range), None when the file changed meanwhile, or
    _TOO_LARGE_FOR_INLINE."""
    with target() as jailed:
        try:
            # Unbuffered: the reads below are in chunks of their own, and a buffered reader
            # costs an isatty ioctl and an lseek per open (a small read_file's hot path).
            found = open_regular_file(jailed, buffering=0)
        except NotADirectoryError:
            raise ToolFailure(NOT_FOUND, "A parent of the path is not a directory.") from None
    if found is None:
        raise ToolFailure(NOT_FOUND, "The file does not exist.")
    opened, before = found
    with opened as file:
        size = before.st_size
        check_size(before, max_file_bytes)
        if inline_max_bytes is not None and size > inline_max_bytes:
            return _TOO_LARGE_FOR_INLINE
        # The git blob header needs the size first; what is read is checked against it.
        digest = hashlib.sha1(b"blob %d\0" % size)
        wanted_end = min(offset + length, size)
        parts: list[bytes] = []
        position = 0
        # Exactly the size seen at open, never to end of file: a file that an agent keeps
        # extending would otherwise keep the read (and, on the fast path, the daemon) going.
        while position < size and (chunk := file.read(min(READ_CHUNK_BYTES, size - position))):
            digest.update(chunk)
            chunk_end = position + len(chunk)
            if chunk_end > offset and position < wanted_end:
                parts.append(chunk[max(offset - position, 0) : wanted_end - position])
            position = chunk_end
        after = os.fstat(file.fileno())
    if position != size or (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
        return None
    return digest.hexdigest(), size, b"".join(parts)

