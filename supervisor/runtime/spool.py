"""The lossless record of a command's output (docs/protocol.md §7.4.6): every byte, up to a cap.

Layout, one directory per call under the state directory:

    <state_dir>/spool/<call_id>/stdout          the bytes, as the command wrote them
    <state_dir>/spool/<call_id>/stdout.state    {"ended","total","kept","truncated"} (JSON)
    <state_dir>/spool/<call_id>/stderr, stderr.state
    <state_dir>/spool/<call_id>/origin          only for a command run under allowed_commands:
                                                its origin, who may read it (§9.1)

Decisions:
- No meta.json: what the call was (command, cwd, context) lives in the store with its
  idempotency record; the spool only holds bytes and the state a reader needs.
- The `.state` sidecar is what makes `eof` and `truncated` answerable by a reader that is not
  the writer, including after a daemon restart. It is replaced atomically (temporary file +
  rename), when the cap is first hit and when the stream ends (`close`), so a reader sees
  either the old state or the new one, never a torn one. `ended` is only set by `close` (or by
  `seal_stream` when recovery finds a stream whose writer died).
- Writes are plain `os.write` calls on an O_APPEND descriptor, with no fsync: the bytes are in
  the page cache the moment write returns, so they survive a kill of the daemon (the case that
  matters: the client pages through them after a restart). A power loss may lose the tail;
  the spool is best effort there, as the journal is not.
- A write the disk refuses (ENOSPC, EIO …) does not stop the command: the stream is marked
  truncated from there on, like hitting the cap, and the error is kept in `write_error`;
  `write` and `close` never raise for it.
- A stream's file (and its `.state`) is created with its first byte: most commands leave a
  stream empty, and each file is a metadata write on every command's path. The call's
  directory is created at once; in it, a stream without a file reads as empty (ended, unless
  the caller says its writer is alive). Recovery seals such a stream with an empty file.
- A stream file already existing is an error (FileExistsError): a command is never run twice,
  so two writers for one call would be a bug that must not silently mix their bytes. (The
  daemon refuses a reused call_id earlier, by its directory.)
- Readers check the state before reading the bytes: the writer writes every byte before it
  marks the stream ended, so a page read after seeing `ended` is complete, and `eof` is never
  claimed for bytes that were still to come.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
from pathlib import Path
from collections.abc import Callable
from typing import NamedTuple

from sandbox_supervisor.protocol.plain import STREAMS, UUID_PATTERN
from sandbox_supervisor.daemon.state.fsutil import fsync_directory

__all__ = [
    "SpoolNotFound",
    "SpoolPage",
    "SpoolWriter",
    "StreamState",
    "read_range",
    "read_state",
    "remove_leftover_temporaries",
    "remove_spool",
    "seal_stream",
    "spool_usage",
    "spool_dir",
    "read_origin",
    "write_origin",
    "stream_path",
    "replace_atomically",
    "temporary_beside",
]

SPOOL_DIRECTORY = "spool"
STATE_SUFFIX = ".state"
SPOOL_DIRECTORY_MODE = 0o700  # output may hold secrets the command printed
_FILE_MODE = 0o600
_CALL_ID = re.compile(UUID_PATTERN)


class SpoolNotFound(LookupError):
    """No spooled stream at this path (unknown call, or its spool was removed)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"no spooled output at {path}")
        self.path = path


# NamedTuples rather than dataclasses: the per-process holder imports this module, and
# `dataclasses` (with the `inspect` it imports) would add about 9 ms to each holder's start
# and 1.5 MiB to its private memory.
class StreamState(NamedTuple):
    ended: bool  # the stream is complete: no byte will be added
    total: int  # bytes the command wrote (also past the cap)
    kept: int  # bytes in the file
    truncated: bool  # bytes were not kept (the cap, or a write the disk refused)

    def to_json(self) -> str:
        fields = {"ended": self.ended, "total": self.total, "kept": self.kept}
        return json.dumps({**fields, "truncated": self.truncated}, sort_keys=True)


class SpoolPage(NamedTuple):
    data: bytes
    eof: bool  # the stream has ended and this page reaches its end
    truncated: bool  # the spool did not keep everything (cap hit)


# A command's spool paths are asked for several times on its call's path (the call_id check,
# the ready directory's rename, both streams' writers, the spawn, the completion): pathlib's
# parsing made each 15 µs on the benchmark machine, about 80 µs a command. Paths are
# immutable, so the recent ones are kept (a refused call_id raises and is not kept).
_PATH_CACHE_SIZE = 64


def spool_dir(state_dir: str | os.PathLike[str], call_id: str) -> Path:
    """`<state_dir>/spool/<call_id>`; the call_id must be a uuid (it becomes a path component)."""
    return _spool_dir(os.fspath(state_dir), call_id)


def stream_path(state_dir: str | os.PathLike[str], call_id: str, stream: str) -> Path:
    return _stream_path(os.fspath(state_dir), call_id, stream)


# The caches sit behind the typed functions above: lru_cache's wrapper takes any hashable
# arguments, so a call site's mistake would no longer be a type error. Keyed by the state
# directory's text, so a Path and its str share one entry.
@functools.lru_cache(maxsize=_PATH_CACHE_SIZE)
def _spool_dir(state_dir: str, call_id: str) -> Path:
    if not _CALL_ID.fullmatch(call_id):
        raise ValueError(f"not a call_id: {call_id!r}")
    return Path(state_dir) / SPOOL_DIRECTORY / call_id


@functools.lru_cache(maxsize=_PATH_CACHE_SIZE)
def _stream_path(state_dir: str, call_id: str, stream: str) -> Path:
    if stream not in STREAMS:
        raise ValueError(f"not a stream: {stream!r}")
    return _spool_dir(state_dir, call_id) / stream


# Who may read a command's spool (docs/protocol.md §9.1): the origin of the allowed_commands
# it ran under, written only for a command that had such a limit (none: no limit), so a
# command of the control plane's own costs no extra file.
ORIGIN_FILE = "origin"


def write_origin(state_dir: str | os.PathLike[str], call_id: str, origin: str) -> None:
    fd = os.open(spool_dir(state_dir, call_id) / ORIGIN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(origin)


def read_origin(state_dir: str | os.PathLike[str], call_id: str) -> str | None:
    """The origin a command's spool records, None when it ran without a limit."""
    try:
        return (spool_dir(state_dir, call_id) / ORIGIN_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def remove_spool(state_dir: str | os.PathLike[str], call_id: str) -> None:
    """Delete a call's spool (when its session ends or the disk cap needs room). Idempotent."""
    import shutil  # here, not at the top: the per-process holder imports this module

    shutil.rmtree(spool_dir(state_dir, call_id), ignore_errors=True)


def _state_path(path: Path) -> Path:
    return path.with_name(path.name + STATE_SUFFIX)


# temporary_beside's names: `.<target name>.<12 hex>.tmp`, and only those (recovery removes
# what a killed writer left, remove_leftover_temporaries).
_TEMPORARY_RANDOM_BYTES = 6
_TEMPORARY_NAME = re.compile(rf"\..+\.[0-9a-f]{{{2 * _TEMPORARY_RANDOM_BYTES}}}\.tmp", re.DOTALL)


def temporary_beside(target: Path) -> tuple[int, Path]:
    """A new file (0600, opened for writing) next to `target`, to be renamed over it: what
    tempfile.mkstemp makes, without importing tempfile and random, which would cost the
    per-process holder 0.8 MiB of private memory and a few milliseconds of every start."""
    while True:
        candidate = target.with_name(f".{target.name}.{os.urandom(_TEMPORARY_RANDOM_BYTES).hex()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(candidate, flags, _FILE_MODE), candidate
        except FileExistsError:
            continue


def replace_atomically(target: Path, text: str, *, durable: bool = False) -> None:
    """Replace `target` with `text` (a temporary file beside it, renamed over it): a reader
    sees the old content or the new, never a torn one. `durable`: the file is fsynced before
    the rename and the directory after, so the new content survives a power loss once this
    returns."""
    fd, temporary = temporary_beside(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable:
        fsync_directory(target.parent)


def remove_leftover_temporaries(
    state_dir: str | os.PathLike[str], *, keep: set[str], older_than: float
) -> int:
    """Remove the temporary files (`temporary_beside`'s) that a writer killed between their
    creation and their rename left in the spool (the daemon's `.state` sidecars, a holder's
    records); returns how many. Not in the directories of `keep` (calls whose holder may be
    alive and writing), and only files last changed before `older_than` (this daemon's start:
    nothing of its own is older). Nothing else in the spool matches the name."""
    removed = 0
    try:
        calls = os.scandir(Path(state_dir) / SPOOL_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    with calls:
        for call in calls:
            if call.name in keep or not _CALL_ID.fullmatch(call.name) or not call.is_dir(follow_symlinks=False):
                continue
            try:
                with os.scandir(call.path) as entries:
                    for entry in entries:
                        if not _TEMPORARY_NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                            continue
                        try:
                            if entry.stat(follow_symlinks=False).st_mtime < older_than:
                                os.unlink(entry.path)
                                removed += 1
                        except FileNotFoundError:
                            continue  # renamed or removed by its writer meanwhile
            except (FileNotFoundError, NotADirectoryError):
                continue  # pruned meanwhile
    return removed


def _write_state(path: Path, state: StreamState) -> None:
    """Replace the state sidecar atomically: a reader sees the old state or the new one."""
    replace_atomically(_state_path(path), state.to_json())


def read_state(path: Path) -> StreamState | None:
    """The stream's recorded state, or None while it runs and has not hit its cap."""
    try:
        document = json.loads(_state_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return StreamState(
        ended=bool(document["ended"]),
        total=int(document["total"]),
        kept=int(document["kept"]),
        truncated=bool(document["truncated"]),
    )


class SpoolWriter:
    """Appends one stream's bytes to its spool file, keeping at most `cap_bytes`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        cap_bytes: int,
        on_truncated: Callable[[], None] | None = None,
        *,
        fresh_directory: bool = False,
    ) -> None:
        """`fresh_directory`: the call's directory was just renamed into place empty (a ready
        spool directory), so there is neither a directory to make nor a stream to find:
        the two checks (a failing mkdir and two stats) are skipped on the command's path."""
        if cap_bytes < 0:
            raise ValueError("cap_bytes must not be negative")
        self.path = Path(path)
        self._cap = cap_bytes
        if not fresh_directory:
            self.path.parent.mkdir(mode=SPOOL_DIRECTORY_MODE, parents=True, exist_ok=True)
            if self.path.exists():
                raise FileExistsError(f"spool stream {self.path} already exists")
        # The file is created with the first byte: most commands leave one stream (often
        # both) empty, and every file created is a metadata write on the command's path. A
        # stream without a file in an existing call directory reads as empty (read_range).
        self._fd: int | None = None
        self._closed = False
        self._size = 0
        self._total = 0
        self._truncated = False
        self._state_unrecorded = False  # the `truncated` state could not be written yet
        # Told when bytes are first dropped (the command host, which may resume the stream).
        self._on_truncated = on_truncated
        self.write_error: str | None = None  # strerror of the write the disk refused

    @classmethod
    def resume(cls, path: str | os.PathLike[str], cap_bytes: int, *, truncated: bool = False) -> SpoolWriter:
        """A writer that goes on where another one's writes ended (it died, or handed the
        stream over): what the file holds is kept, and `total` and `truncated` continue from
        the recorded state. A stream that dropped bytes keeps nothing more. As in `seal_stream`, bytes the other writer dropped past the cap
        after its last recorded state are not counted (it records the state when it first
        drops, and at its close)."""
        path = Path(path)
        previous = read_state(path)
        writer = cls.__new__(cls)
        writer.path = path
        writer._cap = cap_bytes
        writer._fd = None
        writer._closed = False
        writer._on_truncated = None
        writer._state_unrecorded = False
        writer.write_error = None
        writer._size = 0
        try:
            # The file exists once its first byte was written; else the first write creates it.
            writer._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            writer._size = os.fstat(writer._fd).st_size
        except FileNotFoundError:
            pass
        except OSError as exc:
            writer.write_error = exc.strerror or errno.errorcode.get(exc.errno or 0, "error")
        writer._total = max(writer._size, previous.total if previous else 0)
        # `truncated`: the other writer said it dropped bytes, also when its disk refused the
        # state file that says so.
        writer._truncated = truncated or (previous.truncated if previous else False)
        if writer._truncated:
            # Bytes were dropped (the cap, or a disk that refused them): anything appended now
            # would sit at the offsets of bytes that were never kept. Only counted from here.
            writer._cap = writer._size
        return writer

    @property
    def size(self) -> int:
        """Bytes kept in the file."""
        return self._size

    @property
    def total(self) -> int:
        """Bytes seen (written to the spool or not)."""
        return self._total

    @property
    def truncated(self) -> bool:
        return self._truncated

    @property
    def closed(self) -> bool:
        return self._closed

    def keep_at_most(self, nbytes: int) -> None:
        """Keep at most `nbytes` more bytes (the spools' total cap, docs/protocol.md §7.4.6):
        past them the stream is truncated as at its own cap, and keeps nothing more, even if
        room returns later: a byte kept after a dropped one would sit at that one's offset."""
        self._cap = min(self._cap, self._size + max(0, nbytes))

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        try:
            self._fd = os.open(self.path, flags, _FILE_MODE)
        except OSError as exc:
            self.write_error = exc.strerror or errno.errorcode.get(exc.errno or 0, "error")

    def write(self, data: bytes | memoryview) -> int:
        """Keep what fits under the cap; the number of bytes kept. `data` is used only
        during the call (a holder passes a view of its read buffer)."""
        if self._closed:
            raise ValueError("write to a closed spool stream")
        if self._fd is None and data and not self.write_error:
            self._open()
        self._total += len(data)
        room = 0 if self.write_error else self._cap - self._size
        wanted = min(len(data), room)
        kept = 0
        if wanted and self._fd is not None:
            kept = self._write_all(self._fd, memoryview(data)[:wanted])
        self._size += kept
        if kept < len(data) and not self._truncated:
            self._truncated = True
            # Recorded now, not only at close: a reader must see `truncated` while it runs,
            # and a writer that resumes the stream after a crash must not append after a gap.
            self._record(ended=False)
            if self._on_truncated is not None:
                self._on_truncated()
        elif self._truncated and self._state_unrecorded and data:
            self._record(ended=False)  # the disk refused the record before: try again
        return kept

    def _record(self, *, ended: bool) -> None:
        try:
            _write_state(self.path, self._state(ended=ended))
            self._state_unrecorded = False
        except OSError as exc:
            self._state_unrecorded = True
            # Best effort, like the bytes: the command and its result go on without it.
            self.write_error = exc.strerror or errno.errorcode.get(exc.errno or 0, "error")

    def _write_all(self, fd: int, data: memoryview) -> int:
        written = 0
        while written < len(data):
            try:
                written += os.write(fd, data[written:])
            except InterruptedError:
                continue
            except OSError as exc:
                self.write_error = exc.strerror or errno.errorcode.get(exc.errno or 0, "error")
                break
        return written

    def close(self) -> None:
        """The stream has ended: close the file and record the final state. Idempotent.

        Never raises for a disk error (the result must still be reported): `write_error`
        then says why a reader may not see the stream ended.
        """
        if self._closed:
            return
        self._closed = True
        if self._fd is None and self._total == 0:
            return  # nothing was written: no file, and read_range answers "empty, ended"
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._record(ended=True)

    def _state(self, *, ended: bool) -> StreamState:
        return StreamState(
            ended=ended, total=self._total, kept=self._size, truncated=self._truncated
        )


def seal_stream(path: str | os.PathLike[str]) -> StreamState:
    """Mark a stream ended whose writer is gone (recovery after a crash, docs/protocol.md §10.2).

    What the file holds is all there will be. `total` is unknown past what was kept, so it is
    the kept size, unless the cap had been hit (the state then already says more). A stream
    that never got a file (the crash came first) is sealed as empty. Idempotent.
    """
    path = Path(path)
    previous = read_state(path)
    if previous is not None and previous.ended:
        return previous
    try:
        kept = path.stat().st_size
    except FileNotFoundError:
        path.parent.mkdir(mode=SPOOL_DIRECTORY_MODE, parents=True, exist_ok=True)
        path.touch(mode=_FILE_MODE)
        kept = 0
    total = max(kept, previous.total if previous else 0)
    truncated = previous.truncated if previous else False
    state = StreamState(ended=True, total=total, kept=kept, truncated=truncated)
    _write_state(path, state)
    return state


def read_range(
    path: str | os.PathLike[str], offset: int, length: int, *, writer_alive: bool = False
) -> SpoolPage:
    """Up to `length` bytes from `offset` (exec.read_output); SpoolNotFound if no such call.

    A stream without a file in an existing call directory has had no byte yet (files are
    created with their first byte): it reads as empty, ended unless `writer_alive`.
    """
    if offset < 0 or length < 0:
        raise ValueError("offset and length must not be negative")
    path = Path(path)
    state = read_state(path)  # before the bytes: see the module docstring
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise SpoolNotFound(path) from None
        return SpoolPage(data=b"", eof=not writer_alive, truncated=False)
    try:
        chunks: list[bytes] = []
        got = 0
        while got < length:
            piece = os.pread(fd, length - got, offset + got)
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    eof = state is not None and state.ended and offset + len(data) >= state.kept
    return SpoolPage(data=data, eof=eof, truncated=state is not None and state.truncated)


class SpoolUsage(NamedTuple):
    call_id: str
    bytes: int
    mtime: float  # the newest file's, so a spool still written to counts as recent


def spool_usage(state_dir: str | os.PathLike[str]) -> list[SpoolUsage]:
    """Every call's spool with its size on disk, oldest first."""
    root = Path(state_dir) / SPOOL_DIRECTORY
    usage = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not (entry.is_dir(follow_symlinks=False) and _CALL_ID.fullmatch(entry.name)):
            continue
        # Files come and go while running commands write (a `.state` is replaced through a
        # temporary file beside it), and a spool may be removed meanwhile: what vanished
        # between the listing and its stat is simply not counted.
        try:
            size, mtime = 0, entry.stat(follow_symlinks=False).st_mtime
            items = list(os.scandir(entry.path))
        except FileNotFoundError:
            continue
        for item in items:
            try:
                info = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            size += info.st_size
            mtime = max(mtime, info.st_mtime)
        usage.append(SpoolUsage(entry.name, size, mtime))
    usage.sort(key=lambda u: (u.mtime, u.call_id))
    return usage
