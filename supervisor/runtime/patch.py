"""apply_file_patch (docs/protocol.md §7.5): git blob sha, strict unified-diff apply, atomic write.

Three layers, so the rules are testable without files: `apply_unified_diff` is pure (bytes in,
bytes out); `plan_patch` reads the file and decides, writing nothing; `commit_patch` writes the
plan atomically. `recover_patch` is the crash rule of §10.2 as a function of three shas.

The parser is our own, not the `unidiff` library (python-unidiff 1.0.1 was evaluated). It keeps
`\\r` (it splits on "\\n" only) and reports "\\ No newline at end of file" in order, but it does
not fit the contract, because:
- lines past a hunk's stated counts are taken as "patch info" between files and silently
  dropped: `@@ -1,2 +1,2 @@` followed by ` a`, `-b`, `+c`, `+d` parses as a valid hunk
  without `+d`, so the file written would differ from the one the agent meant, where the
  contract says the counts must agree with the header;
- its errors are message strings (UnidiffParseError) without the hunk's index or header, which
  `patch_does_not_apply` must report;
- it is lenient where we are strict (blank lines after a hunk are appended to it as lines).
It parses text, which is not the obstacle: the diff arrives as a JSON string anyway and is
encoded to UTF-8 here; file content outside the hunks never passes through a decoder.

The contract, in more detail than docs/protocol.md §7.5:
- Everything is bytes. The file and the diff are split on b"\\n" only; a line's "\\r" is part
  of its content, so CRLF files keep their endings and bytes that are not UTF-8 outside the
  hunks are kept byte for byte.
- Each hunk applies at exactly the line its header states (`-l,s`: line l, or after line l when
  s is 0), context and removed lines compared byte for byte; the `+l,s` side must agree with
  where the hunk lands in the new file; hunk bodies must have exactly the stated counts; hunks
  come in order and do not overlap. "\\ No newline at end of file" removes the newline of the
  line before it, on whichever side that line belongs to.
- The diff has one `--- ` / `+++ ` header pair. The names in it are not compared with the
  call's `path` (the call's path is the one that counts; `a/` `b/` prefixes, timestamps and
  any names are accepted) except for `/dev/null`: `--- /dev/null` creates (the file must not
  exist), `+++ /dev/null` deletes (every line must be removed). Lines before `--- ` (`diff
  --git`, `index`, mode lines, prose) are ignored; the file's mode is kept whatever they say.
  A second file, a rename or copy, and binary patches are refused.
- Inside a hunk, an empty line is an empty context line (editors strip the lone space; git
  apply reads it the same way). Empty lines after the last hunk are ignored. A diff whose last
  line has no "\\n" is read as if it had one (only the marker means "no newline").
- A diff with no hunks is valid only to create or delete an empty file.

Error codes: `invalid_parameters` when the diff is not a unified diff of one file, whatever
the file holds (empty, no header, several files, binary, no hunks); `patch_does_not_apply`
when it is one but does not fit this file: `{"hunk": {"index", "header", "reason"}}` (index
from 0) when one hunk is at fault (malformed header, wrong counts, context mismatch, wrong
position, stray line after it), `{"reason"}` when the diff as a whole does not fit (creates a
file that exists, modifies or deletes one that does not, deletes but leaves lines).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import structlog
from structlog.typing import FilteringBoundLogger

from sandbox_supervisor.protocol.errors import (
    BASE_SHA_MISMATCH,
    FILE_TOO_LARGE,
    INTERNAL,
    INVALID_PARAMETERS,
    PATCH_DOES_NOT_APPLY,
)
from sandbox_supervisor.protocol.tools import PatchResult
from sandbox_supervisor.protocol.tools import ApplyFilePatchParams
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.files import (
    DEFAULT_MAX_FILE_BYTES,
    READ_CHUNK_BYTES,
    check_regular_file,
    check_size,
    open_entry,
    open_regular_file,
)
from sandbox_supervisor.daemon.runtime.paths import READ_FLAGS, JailedPath, open_path

log: FilteringBoundLogger = structlog.get_logger("supervisor.patch")

__all__ = [
    "NEW_FILE_MODE",
    "RecoveryOutcome",
    "ZERO_SHA",
    "DiffOutcome",
    "PatchError",
    "PatchPlan",
    "apply_unified_diff",
    "commit_patch",
    "current_sha",
    "git_blob_sha",
    "plan_patch",
    "recover_patch",
]

# The sha of "no file" (§7.5): base_sha of a file to create, new_sha of a deleted one.
ZERO_SHA = "0" * 40
# Mode of a created file before the umask, as an editor would create it. A replaced file keeps
# its own mode exactly (set with fchmod, so the umask cannot strip bits from it).
NEW_FILE_MODE = 0o644
# Mode of directories created for a new file, before the umask (what `mkdir -p` uses).
NEW_DIRECTORY_MODE = 0o777
# A hunk header is echoed into a journaled error; a junk one must not bloat the journal.
MAX_ECHOED_HEADER_CHARS = 200
# Temp files sit next to the target, hidden, with a random part so two writers never meet.
TEMP_PREFIX = "."
TEMP_SUFFIX = ".patch-tmp"
TEMP_RANDOM_BYTES = 8
# At most 4 bytes a char in UTF-8: 32 chars keep a temp name far below NAME_MAX.
TEMP_NAME_CHARS = 32
PRIVATE_TEMP_MODE = 0o600
# The base sha is hashed in chunks of this size, the file loaded only once it matches.
HASH_CHUNK_BYTES = READ_CHUNK_BYTES
# A file up to this size is read once, whole, and hashed from memory: a wrong base_sha then
# costs at most this much memory, and a right one saves a second read and a second hash
# (about 70 µs for 100 KB). Larger files are hashed streaming first, loaded only on a match.
LOAD_AT_ONCE_BYTES = READ_CHUNK_BYTES
# A directory on the way to a created file, opened to create in it, fchown and fsync it:
# never through a symlink.
_DIRECTORY_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# _Lines skips this many bytes at a time (one bytes.count) on its way to a hunk's line.
LINE_SCAN_BLOCK_BYTES = 4096
# ...unless the line wanted is at most this many lines ahead: then line by line at once.
LINE_SCAN_NEAR_LINES = 32

_DEV_NULL = b"/dev/null"
_NEWLINE = b"\n"
_CONTEXT, _REMOVED, _ADDED, _MARKER = b" ", b"-", b"+", b"\\"
# Numbers of at most 16 digits (a line count fits in a JSON-safe integer): a longer one is a
# malformed header, not a 5,000-digit int() that Python refuses with a ValueError.
_HUNK_HEADER = re.compile(
    rb"@@ -(\d{1,16})(?:,(\d{1,16}))? \+(\d{1,16})(?:,(\d{1,16}))? @@(.*)", re.DOTALL
)


class PatchError(ToolFailure):
    """A patch that cannot be applied; `code` says why (base_sha_mismatch, patch_does_not_apply,
    invalid_parameters, not_found)."""


@dataclass(frozen=True)
class DiffOutcome:
    new: bytes | None  # None: the diff deletes the file
    hunks: int


@dataclass(frozen=True)
class PatchPlan:
    path: Path
    display_path: str
    old_sha: str  # ZERO_SHA: the file is created
    new_sha: str  # ZERO_SHA: the file is deleted
    new_bytes: bytes | None  # None: delete
    hunks: int
    mode: int | None  # permission bits of the existing file; None when it is created
    # The existing file's (uid, gid), kept on the replacement when the daemon writes as
    # another user (it is root under privilege separation); None when it is created.
    owner: tuple[int, int] | None = None
    # Where to write: the jail's descriptors (open while the tool runs); None for a plan of a
    # path the caller vouches for, which commit_patch opens again.
    target: JailedPath | None = field(default=None, compare=False, repr=False)
    # The file's content as planned against (None when it is created): commit_patch compares
    # the file with it before writing, which is cheaper than hashing it again.
    original: bytes | None = field(default=None, compare=False, repr=False)

    def result(self) -> dict[str, Any]:
        """The `apply_file_patch` result (docs/protocol.md §7.5)."""
        return PatchResult(
            path=self.display_path,
            old_sha=self.old_sha,
            new_sha=self.new_sha,
            hunks=self.hunks,
            bytes=0 if self.new_bytes is None else len(self.new_bytes),
        ).model_dump()


def git_blob_sha(data: bytes) -> str:
    """The git blob SHA-1 of `data`: what `git hash-object` prints for a file holding it."""
    digest = hashlib.sha1(b"blob %d\0" % len(data))
    digest.update(data)
    return digest.hexdigest()


# --- the pure part ------------------------------------------------------------------------


@dataclass
class _Hunk:
    index: int
    header: bytes
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    # (tag, content); content ends with b"\n" unless a marker followed the line.
    body: list[tuple[bytes, bytes]]

    def fail(self, reason: str) -> PatchError:
        header = self.header.decode("utf-8", "replace")[:MAX_ECHOED_HEADER_CHARS]
        return PatchError(
            PATCH_DOES_NOT_APPLY,
            f"Hunk {self.index} ({header}) does not apply: {reason}",
            {"hunk": {"index": self.index, "header": header, "reason": reason}},
        )

    def side(self, tags: tuple[bytes, bytes]) -> list[bytes]:
        return [content for tag, content in self.body if tag in tags]


@dataclass
class _Diff:
    creates: bool
    deletes: bool
    hunks: list[_Hunk]


def apply_unified_diff(original: bytes | None, diff: str) -> DiffOutcome:
    """Apply `diff` to `original` (None: the file does not exist) strictly; raise PatchError."""
    parsed = _parse(_diff_lines(diff))
    if parsed.creates and original is not None:
        raise _does_not_fit("the diff creates the file (--- /dev/null) but it exists")
    if not parsed.creates and original is None:
        raise _does_not_fit(
            "the file does not exist; a diff that creates it starts with '--- /dev/null'"
        )
    lines = _Lines(original or b"")
    pieces: list[bytes] = []
    cursor = 0  # index of the first original line not yet copied
    emitted = 0  # lines of the new file so far
    for hunk in parsed.hunks:
        cursor, emitted = _apply_hunk(hunk, lines, cursor, emitted, pieces)
    pieces.append(lines.tail(cursor))
    new = b"".join(pieces)
    if parsed.deletes:
        if new:
            emitted += lines.count - cursor
            raise _does_not_fit(
                f"the diff deletes the file (+++ /dev/null) but leaves {emitted} line(s)"
            )
        return DiffOutcome(new=None, hunks=len(parsed.hunks))
    return DiffOutcome(new=new, hunks=len(parsed.hunks))


class _Lines:
    """The lines of a file (each with its b"\\n"; the last one may lack it), found lazily.

    A small edit of a large file touches a few lines: the lines between hunks are copied as
    one slice each, and a line's offset is found only when a hunk needs it, by skipping
    blocks of LINE_SCAN_BLOCK_BYTES with bytes.count and then going line by line with
    bytes.index; the rest of the file is never scanned (even counting all its newlines costs
    about 35 µs for 100 KB). Splitting a 100 KB file (1,600 lines) into a list of lines took
    about 0.2 ms, most of a small patch's CPU. Lines end at b"\\n" only, never where
    str.splitlines would also split (\\r, \\x0b, \\x1c, \\u2028 and more).
    """

    __slots__ = ("data", "_count", "_line", "_offset", "_known")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._count: int | None = None
        # Where the scan stands (line `_line` starts at `_offset`), and every offset found.
        self._line = 0
        self._offset = 0
        self._known: dict[int, int] = {0: 0}

    @property
    def count(self) -> int:
        """The number of lines (scans the whole file: only for what needs the total)."""
        if self._count is None:
            data = self.data
            self._count = data.count(_NEWLINE) + (1 if data and not data.endswith(_NEWLINE) else 0)
        return self._count

    def has(self, lines: int) -> bool:
        """Whether the file has at least `lines` lines (scans only up to there)."""
        return lines == 0 or self.start(lines - 1) < len(self.data)

    def start(self, index: int) -> int:
        """Offset of line `index` (0-based); the end of the data for a line past the last."""
        known = self._known.get(index)
        if known is not None:
            return known
        line, offset = self._line, self._offset
        if index < line:
            # Behind the scan: only the search for a hunk's mismatched line comes back here,
            # once, on the way to an error. From the nearest line known before it.
            line = max(known for known in self._known if known < index)
            offset = self._known[line]
        data = self.data
        end = len(data)
        while offset < end and index - line > LINE_SCAN_NEAR_LINES:
            in_block = data.count(_NEWLINE, offset, offset + LINE_SCAN_BLOCK_BYTES)
            if line + in_block >= index:
                break
            line += in_block
            offset = min(offset + LINE_SCAN_BLOCK_BYTES, end)
        while line < index:
            found = data.find(_NEWLINE, offset)
            if found < 0:
                # Past the last newline: a final line without one, then nothing.
                line, offset = index, end
                break
            offset = found + 1
            line += 1
        self._line, self._offset = line, offset
        self._known[index] = offset
        return offset

    def line(self, index: int) -> bytes:
        return self.data[self.start(index) : self.start(index + 1)]

    def span(self, first: int, end: int) -> bytes:
        """Lines first..end-1 as one slice."""
        return self.data[self.start(first) : self.start(end)]

    def tail(self, first: int) -> bytes:
        return self.data[self.start(first) :]


def _apply_hunk(
    hunk: _Hunk, lines: _Lines, cursor: int, emitted: int, pieces: list[bytes]
) -> tuple[int, int]:
    """Copy up to the hunk, check its old side, emit its new side: the new cursor, and the
    new file's line count so far (`emitted` before the hunk)."""
    old = hunk.side((_CONTEXT, _REMOVED))
    new = hunk.side((_CONTEXT, _ADDED))
    # "-l,s": the hunk starts at line l; with s == 0 it inserts after line l (0: at the top).
    start = hunk.old_start - 1 if hunk.old_len else hunk.old_start
    if start < cursor:
        raise hunk.fail("it overlaps the previous hunk or comes before it")
    end = start + hunk.old_len
    copied = lines.span(cursor, start)  # first: _Lines scans forward
    if not lines.has(end):
        raise hunk.fail(f"it reaches past the end of the file ({lines.count} lines)")
    # Each old-side line holds exactly one b"\n", at its end (the last may have none), as the
    # file's lines do: equal as one slice means equal line by line. Only a mismatch is
    # looked for line by line, for the error.
    if lines.span(start, end) != b"".join(old):
        for offset, expected in enumerate(old):
            actual = lines.line(start + offset)
            if expected != actual:
                hint = _hint(expected, actual)
                raise hunk.fail(f"line {start + offset + 1} differs from the hunk{hint}")
    pieces.append(copied)
    emitted += start - cursor
    # The same convention on the new side: where the hunk's new lines land in the result.
    expected_new_start = emitted + 1 if hunk.new_len else emitted
    if hunk.new_start != expected_new_start:
        raise hunk.fail(
            f"its new side starts at line {hunk.new_start}, but it lands at line "
            f"{expected_new_start}"
        )
    for position, line in enumerate(new):
        if not line.endswith(_NEWLINE) and (position != len(new) - 1 or end != lines.count):
            raise hunk.fail("'\\ No newline at end of file' follows a line that is not the last")
    pieces.extend(new)
    return end, emitted + len(new)


def _hint(expected: bytes, actual: bytes) -> str:
    if expected.rstrip(b"\r\n") == actual.rstrip(b"\r\n"):
        return " (only the line ending differs: CRLF, LF or no newline at end of file)"
    return ""


def _does_not_fit(reason: str) -> PatchError:
    return PatchError(
        PATCH_DOES_NOT_APPLY, f"The diff does not apply: {reason}.", {"reason": reason}
    )


def _not_a_diff(reason: str) -> PatchError:
    return PatchError(INVALID_PARAMETERS, f"diff: {reason}.")


def _diff_lines(diff: str) -> list[bytes]:
    try:
        data = diff.encode("utf-8")
    except UnicodeEncodeError:
        # Only a lone surrogate gets here; the frame parser refuses them, other callers may not.
        raise _not_a_diff("not valid Unicode text") from None
    parts = data.split(_NEWLINE)
    if parts[-1] == b"":
        parts.pop()  # the terminator of the last line, not an empty line
    return parts


def _is_file_header(lines: list[bytes], i: int) -> bool:
    return (
        lines[i].startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")
    )


def _names_dev_null(header_line: bytes) -> bool:
    name = header_line[4:].split(b"\t", 1)[0].rstrip(b"\r")
    return name == _DEV_NULL


# Preamble lines that mean "not a plain content diff of one file".
_REFUSED_PREAMBLE = (
    (b"Binary files ", "binary diffs are not supported"),
    (b"GIT binary patch", "binary diffs are not supported"),
    (b"rename from ", "renames are not supported; send a diff of one path"),
    (b"copy from ", "copies are not supported; send a diff of one path"),
)


def _parse(lines: list[bytes]) -> _Diff:
    if not any(line.strip() for line in lines):
        raise _not_a_diff("the diff is empty")
    i = _skip_preamble(lines)
    if i == len(lines):
        raise _not_a_diff("no '--- ' / '+++ ' file header")
    creates, deletes = _names_dev_null(lines[i]), _names_dev_null(lines[i + 1])
    if creates and deletes:
        raise _not_a_diff("both sides are /dev/null")
    i += 2
    hunks: list[_Hunk] = []
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"@@"):
            hunk, i = _parse_hunk(lines, i, len(hunks))
            hunks.append(hunk)
        elif _is_file_header(lines, i) or line.startswith(b"diff "):
            raise _not_a_diff("it holds more than one file; send one call per file")
        elif not any(rest for rest in lines[i:]):
            break  # trailing empty lines carry nothing
        elif hunks:
            raise hunks[-1].fail(
                f"diff line {i + 1} follows it but is not a hunk header "
                "(the hunk has more lines than its header states)"
            )
        else:
            raise _not_a_diff(f"diff line {i + 1} after the file header is not a hunk header")
    if not hunks and not (creates or deletes):
        raise _not_a_diff("it has no hunks")
    return _Diff(creates=creates, deletes=deletes, hunks=hunks)


def _skip_preamble(lines: list[bytes]) -> int:
    """Index of the `--- ` line (len(lines) if none); refuses what the preamble must not say."""
    files = 0
    for i, line in enumerate(lines):
        if _is_file_header(lines, i):
            return i
        if line.startswith(b"diff "):
            files += 1
            if files > 1:
                raise _not_a_diff("it holds more than one file; send one call per file")
        if line.startswith(b"@@"):
            raise _not_a_diff(f"diff line {i + 1}: a hunk before the '--- ' / '+++ ' header")
        for prefix, reason in _REFUSED_PREAMBLE:
            if line.startswith(prefix):
                raise _not_a_diff(reason)
    return len(lines)


def _parse_hunk(lines: list[bytes], i: int, index: int) -> tuple[_Hunk, int]:
    """Parse the hunk whose header is lines[i]; the hunk and the index of the line after it."""
    header = lines[i]
    match = _HUNK_HEADER.fullmatch(header)
    hunk = _Hunk(index, header, old_start=0, old_len=0, new_start=0, new_len=0, body=[])
    if match is None:
        raise hunk.fail("malformed hunk header (expected '@@ -l,s +l,s @@')")
    # An omitted length is 1 (the unified format's rule).
    hunk.old_start, hunk.new_start = int(match[1]), int(match[3])
    hunk.old_len = 1 if match[2] is None else int(match[2])
    hunk.new_len = 1 if match[4] is None else int(match[4])
    if hunk.old_len == hunk.new_len == 0:
        raise hunk.fail("malformed hunk header (a hunk without lines)")
    if (hunk.old_start == 0 and hunk.old_len) or (hunk.new_start == 0 and hunk.new_len):
        raise hunk.fail("malformed hunk header (a side starts at line 0 but has lines)")
    old_seen = new_seen = 0
    i += 1
    while i < len(lines):
        raw = lines[i]
        if raw.startswith(_MARKER):
            if not hunk.body or not hunk.body[-1][1].endswith(_NEWLINE):
                raise hunk.fail(f"diff line {i + 1}: a '\\' marker that follows no line")
            tag, content = hunk.body[-1]
            hunk.body[-1] = (tag, content[:-1])
            i += 1
            continue
        if old_seen == hunk.old_len and new_seen == hunk.new_len:
            break
        # An empty line is an empty context line whose lone space was stripped.
        tag, content = (raw[:1], raw[1:]) if raw else (_CONTEXT, b"")
        if tag not in (_CONTEXT, _REMOVED, _ADDED):
            break  # reported below as a short hunk
        if tag != _ADDED:
            old_seen += 1
        if tag != _REMOVED:
            new_seen += 1
        if old_seen > hunk.old_len or new_seen > hunk.new_len:
            raise hunk.fail(
                f"diff line {i + 1}: more lines than its header states "
                f"(-{hunk.old_len} +{hunk.new_len})"
            )
        hunk.body.append((tag, content + _NEWLINE))
        i += 1
    if old_seen < hunk.old_len or new_seen < hunk.new_len:
        raise hunk.fail(
            f"fewer lines than its header states (-{old_seen} +{new_seen} of "
            f"-{hunk.old_len} +{hunk.new_len})"
        )
    return hunk, i


# --- the file system part -----------------------------------------------------------------
#
# Every file operation is relative to a directory descriptor from the jail's walk
# (paths.JailedPath), one component at a time and never following a symlink: the agent may
# swap any component for a symlink at any moment, and the daemon (root) must not read, create,
# rename or unlink anything but the entry the jail judged.

Target = Path | JailedPath


@contextmanager
def _jailed(target: Target) -> Iterator[JailedPath]:
    """The target as descriptors: as given, or a path the caller vouches for (tests) opened
    the same way."""
    if isinstance(target, JailedPath):
        yield target
    else:
        with open_path(target, READ_FLAGS) as jailed:
            yield jailed


def _open_target(jailed: JailedPath, max_file_bytes: int) -> tuple[BinaryIO, os.stat_result] | None:
    """The opened regular file and its fstat, None when nothing is there; file_too_large
    (from the opened file's fstat, before a byte is read) over `max_file_bytes`."""
    try:
        found = open_regular_file(jailed)
    except NotADirectoryError:
        raise PatchError(INVALID_PARAMETERS, "A parent of the path is not a directory.") from None
    if found is None:
        return None
    opened, info = found
    try:
        check_size(info, max_file_bytes)
    except BaseException:
        opened.close()
        raise
    return opened, info


def _changed_while_read() -> ToolFailure:
    return ToolFailure(INTERNAL, "The file changed while it was read; nothing was written.")


def _hash_from_start(file: BinaryIO, size: int) -> str:
    """Git blob sha of the first `size` bytes, streamed: memory stays at one chunk, and the
    read stops at `size` even if the file keeps growing."""
    digest = hashlib.sha1(b"blob %d\0" % size)
    remaining = size
    while remaining:
        chunk = file.read(min(HASH_CHUNK_BYTES, remaining))
        if not chunk:
            raise _changed_while_read()  # it shrank: the size no longer describes it
        digest.update(chunk)
        remaining -= len(chunk)
    return digest.hexdigest()


def _read_exactly(file: BinaryIO, size: int) -> bytes:
    """The first `size` bytes (the fstat's size): the read stops there even if the file keeps
    growing, and a file that shrank meanwhile is reported, as `_hash_from_start` does."""
    data = file.read(size)
    if len(data) != size:
        raise _changed_while_read()
    return data


def current_sha(target: Target, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> str:
    """Git blob sha of the file at `target`; ZERO_SHA when there is none (crash recovery).
    Streamed, never loaded; file_too_large over `max_file_bytes`."""
    with _jailed(target) as jailed:
        found = _open_target(jailed, max_file_bytes)
    if found is None:
        return ZERO_SHA
    opened, info = found
    with opened as file:
        return _hash_from_start(file, info.st_size)


def plan_patch(
    target: Target,
    display_path: str,
    params: ApplyFilePatchParams,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> PatchPlan:
    """Decide the patch of `target` (the jailed file, or a path the caller vouches for);
    nothing is written.

    Raises PatchError: base_sha_mismatch (with current_sha), patch_does_not_apply,
    invalid_parameters (malformed diff; a directory or other non-regular file at the path);
    ToolFailure: file_too_large (the file, or the patched result, is over `max_file_bytes`).

    The base sha is checked by streaming the file through the hash first; the file is loaded
    only when it matches, so a wrong-sha patch of a large file costs one chunk of memory.
    """
    with _jailed(target) as jailed:
        found = _open_target(jailed, max_file_bytes)
        real_path = jailed.real_path
    original: bytes | None = None
    mode: int | None = None
    owner: tuple[int, int] | None = None
    old_sha = ZERO_SHA
    if found is not None:
        opened, info = found
        mode = stat.S_IMODE(info.st_mode)
        owner = (info.st_uid, info.st_gid)
        with opened as file:
            if info.st_size <= LOAD_AT_ONCE_BYTES:
                loaded = _read_exactly(file, info.st_size)
                old_sha = git_blob_sha(loaded)
                if old_sha == params.base_sha:
                    original = loaded
            else:
                old_sha = _hash_from_start(file, info.st_size)
                if old_sha == params.base_sha:
                    file.seek(0)
                    original = file.read(info.st_size)
                if original is not None and git_blob_sha(original) != old_sha:
                    # Rewritten between the hash and the load: the loaded bytes are the file now.
                    old_sha = git_blob_sha(original)
    if old_sha != params.base_sha:
        raise PatchError(
            BASE_SHA_MISMATCH,
            "base_sha does not match the file's current content.",
            {"current_sha": old_sha},
        )
    outcome = apply_unified_diff(original, params.diff)
    if outcome.new is not None and len(outcome.new) > max_file_bytes:
        # The limit holds for what a patch writes too, so a later read_file can read it.
        raise ToolFailure(
            FILE_TOO_LARGE,
            f"The patched file would be {len(outcome.new)} bytes; the limit is "
            f"{max_file_bytes} bytes.",
            {"size": len(outcome.new), "max_bytes": max_file_bytes},
        )
    new_sha = ZERO_SHA if outcome.new is None else git_blob_sha(outcome.new)
    return PatchPlan(
        path=real_path,
        display_path=display_path,
        old_sha=old_sha,
        new_sha=new_sha,
        new_bytes=outcome.new,
        hunks=outcome.hunks,
        mode=mode,
        owner=owner,
        target=target if isinstance(target, JailedPath) else None,
        original=original,
    )


def commit_patch(
    plan: PatchPlan,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    new_owner: tuple[int, int] | None = None,
) -> None:
    """Write the plan atomically: readers see the old file or the new one, never a mix.

    The file is checked once more against plan.old_sha right before writing, which narrows
    (it cannot close) the window in which another writer changed it since the plan; the
    dispatcher serialises patches of one path. Missing parent directories of a new file are
    created (the jail already admitted the whole path; agents expect `mkdir -p`), one at a
    time with mkdirat and then opened with O_NOFOLLOW, so one the agent swaps for a symlink
    is refused, never followed. The temp file is created, and renamed over the target, in
    the parent's descriptor: whatever the path now names, only that directory's entry
    changes.

    Ownership: with `new_owner` (uid, gid) — the command user under privilege separation,
    where the daemon writes as root — a created file and every directory created for it
    belong to that user (fchown of the opened descriptor), and a replaced file keeps its old
    owner, so the agent can go on editing what the control plane patched. Without it the
    supervisor writes as itself (the agent's user when there is no separation) and the owner
    is not kept. A kill between the temp file's creation and the rename leaves a
    `.<name>.<random>.patch-tmp` file behind, never a half-written target.
    """
    with _jailed(plan.path if plan.target is None else plan.target) as jailed:
        _commit(plan, jailed, max_file_bytes, new_owner)


def _commit(
    plan: PatchPlan, jailed: JailedPath, max_file_bytes: int, new_owner: tuple[int, int] | None
) -> None:
    opened: list[int] = []  # directories created and opened here, closed at the end
    try:
        if jailed.state == "missing":
            # The file is created: its directories may exist by now (mkdir -p does not mind).
            directory = _descend(jailed.parent_fd, jailed.tail[:-1], opened, None)
            name = jailed.tail[-1]
        else:
            directory, name = jailed.parent_fd, jailed.name
        now = ZERO_SHA if directory is None else _sha_at(directory, name, max_file_bytes, plan)
        if now != plan.old_sha:
            raise PatchError(
                BASE_SHA_MISMATCH,
                "The file changed between planning and writing the patch.",
                {"current_sha": now},
            )
        if plan.new_bytes is None:
            assert directory is not None  # a file to delete exists
            os.unlink(name, dir_fd=directory)
            _settle(directory, plan.path.parent)
            return
        if directory is None:
            directory = _descend(jailed.parent_fd, jailed.tail[:-1], opened, new_owner, create=True)
            assert directory is not None
        _write_replace(plan, directory, name, new_owner)
        _settle(directory, plan.path.parent)
    finally:
        for fd in opened:
            os.close(fd)


def _sha_at(directory: int, name: str, max_file_bytes: int, plan: PatchPlan) -> str:
    """Git blob sha of `name` in `directory` (never through a symlink); ZERO_SHA if absent.

    When the file still holds exactly the bytes the plan was made against, their sha is the
    plan's old_sha, known without hashing: a small file is read and compared instead (a read
    and a memcmp against a SHA-1, about 10 µs against 70 µs for 100 KB). Equal bytes have
    equal shas, so the answer is the one hashing would give."""
    fd = open_entry(directory, name, "The file was replaced by a symlink while it was patched; nothing was written.")
    if fd is None:
        return ZERO_SHA
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        check_regular_file(info.st_mode)
        check_size(info, max_file_bytes)
        expected = plan.original
        if expected is not None and info.st_size == len(expected) and info.st_size <= LOAD_AT_ONCE_BYTES:
            now = _read_exactly(file, info.st_size)
            return plan.old_sha if now == expected else git_blob_sha(now)
        return _hash_from_start(file, info.st_size)


def _write_replace(plan: PatchPlan, directory: int, name: str, new_owner: tuple[int, int] | None) -> None:
    assert plan.new_bytes is not None
    temp = _temp_name(name)
    # A replaced file's bits are set with fchmod below; until then only we may open it.
    create_mode = NEW_FILE_MODE if plan.mode is None else PRIVATE_TEMP_MODE
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, create_mode, dir_fd=directory)
    try:
        try:
            owner = new_owner if plan.owner is None else plan.owner
            if new_owner is not None and owner is not None:
                # Before the fchmod: chown clears set-user/group-ID bits the mode may carry.
                os.fchown(fd, *owner)
            if plan.mode is not None:
                os.fchmod(fd, plan.mode)  # exactly the old bits; the umask does not apply
            view = memoryview(plan.new_bytes)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        # rename(2) replaces the entry itself: a symlink swapped in at `name` is replaced,
        # never followed.
        os.rename(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=directory)
        except FileNotFoundError:
            pass
        raise


def _descend(
    parent: int,
    names: list[str],
    opened: list[int],
    owner: tuple[int, int] | None,
    *,
    create: bool = False,
) -> int | None:
    """The directory `names` lead to below `parent`, opened with O_NOFOLLOW one level at a
    time; None when one is missing and `create` is False. With `create`, missing ones are
    made (mkdir -p), each made durable in its parent and, with `owner`, given to that
    (uid, gid) so the command user can write in it. A symlink or a file where a directory
    is wanted is refused: the jail judged these names as missing, so something replaced
    them meanwhile."""
    directory = parent
    for name in names:
        made = False
        if create:
            try:
                os.mkdir(name, NEW_DIRECTORY_MODE, dir_fd=directory)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIRECTORY_OPEN_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            if create:
                raise  # removed right after mkdir: the error says so
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise PatchError(
                INVALID_PARAMETERS, "A parent of the path is not a directory."
            ) from None
        opened.append(fd)
        if made:
            if owner is not None:
                os.fchown(fd, *owner)
            os.fsync(_fsyncable(directory, opened))
        directory = fd
    return directory


def _fsyncable(directory: int, opened: list[int]) -> int:
    """A descriptor of `directory` that fsync accepts (the walk's are O_PATH, which it does
    not): the directory itself when it was opened here, else "." opened through it."""
    if directory in opened:
        return directory
    fd = os.open(".", _DIRECTORY_OPEN_FLAGS, dir_fd=directory)
    opened.append(fd)
    return fd


def _settle(directory: int, shown: Path) -> None:
    """Make the rename (or unlink) durable. It is visible already, so a directory the file
    system will not fsync costs durability across a power loss, not the patch: logged, and
    the patch is reported applied, as it is (answering "not written" would be false)."""
    try:
        fd = os.open(".", _DIRECTORY_OPEN_FLAGS, dir_fd=directory)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("patch.fsync_failed", directory=str(shown), error=exc.strerror)


def _temp_name(name: str) -> str:
    # Part of the target's name helps a human who finds a leftover; cut so the whole name
    # stays under NAME_MAX (255 bytes) whatever the target's name is.
    stem = name[:TEMP_NAME_CHARS]
    return f"{TEMP_PREFIX}{stem}.{secrets.token_hex(TEMP_RANDOM_BYTES)}{TEMP_SUFFIX}"


# What _temp_name makes, exactly: the stem, a dot, the random part in lowercase hex, the suffix.
_TEMP_NAME = re.compile(
    rf"{re.escape(TEMP_PREFIX)}(?P<stem>.*)\.[0-9a-f]{{{2 * TEMP_RANDOM_BYTES}}}{re.escape(TEMP_SUFFIX)}", re.DOTALL
)


def remove_leftover_temps(target: JailedPath, *, older_than: float) -> int:
    """Remove the temp files a killed write of this target left beside it; returns how many.

    Only what this module's `_temp_name` makes for this target's name (`.<name>.<16 hex>
    .patch-tmp`), only regular files, and only those last changed before `older_than` (the
    start of recovery: nothing of this daemon's is older), in the target's own directory,
    through the jail's descriptor (never a path an agent could swap for a symlink). Agent
    files never match: the agent would have to choose exactly this name."""
    if target.state == "open" and target.name != ".":
        directory, name = target.parent_fd, target.name
    elif target.state == "missing" and len(target.tail) == 1:
        directory, name = target.parent_fd, target.tail[0]
    else:
        return 0  # the target's directory does not exist: no temp file can be in it
    stem = name[:TEMP_NAME_CHARS]
    removed = 0
    try:
        # The walk's descriptors may be O_PATH (not listable): the same directory, reopened.
        listable = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
        try:
            entries = os.listdir(listable)
        finally:
            os.close(listable)
    except OSError:
        return 0  # cleaning is a courtesy: it never fails the recovery of the call
    for entry in entries:
        matched = _TEMP_NAME.fullmatch(entry)
        if matched is None or matched["stem"] != stem:
            continue
        try:
            info = os.stat(entry, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_mtime < older_than:
                os.unlink(entry, dir_fd=directory)
                removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove after all
    return removed


RecoveryOutcome = Literal["applied", "apply_now", "interrupted"]


def recover_patch(current: str, old_sha: str, new_sha: str) -> RecoveryOutcome:
    """docs/protocol.md §10.2 for a patch left pending by a crash, from the file's sha now.

    New content first: a patch that changes nothing (old == new) counts as applied. For
    "apply_now", re-running plan_patch with the recorded parameters gives the same plan (the
    base content is the same bytes), then commit_patch.
    """
    if current == new_sha:
        return "applied"
    if current == old_sha:
        return "apply_now"
    return "interrupted"
