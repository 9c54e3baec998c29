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
- A missing file is `not_found`; a directory (agent.cwd included) or a special file is
  `invalid_parameters`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Literal

from sandbox_supervisor.protocol.errors import INTERNAL, INVALID_PARAMETERS, NOT_FOUND
from sandbox_supervisor.protocol.tools import ReadFileResult
from sandbox_supervisor.protocol.tools import MAX_READ_LENGTH, ReadFileParams
from sandbox_supervisor.daemon.runtime.failures import ToolFailure, os_failure

__all__ = ["check_regular_file", "open_regular_file", "read_file_result"]

READ_CHUNK_BYTES = 1024 * 1024
# A file rewritten while we hash it is read again; a file that never holds still is an error.
MAX_READ_ATTEMPTS = 3


def read_file_result(target: Path, display_path: str, params: ReadFileParams) -> dict[str, Any]:
    """The read_file result for `target` (a jailed real path); raises ToolFailure."""
    length = MAX_READ_LENGTH if params.length is None else params.length
    for _ in range(MAX_READ_ATTEMPTS):
        try:
            read = _read_once(target, params.offset, length)
        except OSError as exc:
            raise os_failure(exc, "read") from None
        if read is not None:
            break
    else:
        raise ToolFailure(INTERNAL, "The file kept changing while it was read.")
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


def open_regular_file(path: Path) -> tuple[BinaryIO, os.stat_result]:
    """Open a regular file for reading, with its stat; ToolFailure for a directory or a
    special file. FileNotFoundError and NotADirectoryError pass through: what they mean
    depends on the tool (a missing file is an error to read, a file to create for a patch)."""
    # O_NONBLOCK: opening a fifo must not wait for a writer; it is refused just below.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        check_regular_file(info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    # fdopen refuses a directory's fd, hence the check above before it takes ownership.
    return os.fdopen(fd, "rb"), info


def _read_once(target: Path, offset: int, length: int) -> tuple[str, int, bytes] | None:
    """(git blob sha, size, bytes of the range), or None when the file changed meanwhile."""
    try:
        opened, before = open_regular_file(target)
    except FileNotFoundError:
        raise ToolFailure(NOT_FOUND, "The file does not exist.") from None
    except NotADirectoryError:
        raise ToolFailure(NOT_FOUND, "A parent of the path is not a directory.") from None
    with opened as file:
        size = before.st_size
        # The git blob header needs the size first; what is read is checked against it.
        digest = hashlib.sha1(b"blob %d\0" % size)
        wanted_end = min(offset + length, size)
        parts: list[bytes] = []
        position = 0
        while chunk := file.read(READ_CHUNK_BYTES):
            digest.update(chunk)
            chunk_end = position + len(chunk)
            if chunk_end > offset and position < wanted_end:
                parts.append(chunk[max(offset - position, 0) : wanted_end - position])
            position = chunk_end
        after = os.fstat(file.fileno())
    if position != size or (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
        return None
    return digest.hexdigest(), size, b"".join(parts)
