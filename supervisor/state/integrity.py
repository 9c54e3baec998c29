"""Whether the state on disk is the state this sandbox had: checked before the daemon serves.

sqlite alone cannot tell "a brand-new sandbox" from "a sandbox whose database was deleted,
truncated, or rolled back by losing its hot `-wal`": each opens as a valid (empty or older)
database, and a daemon that started on it would reuse sequence numbers the control plane
already holds and run already-answered calls again. So the state directory carries evidence
that lives outside the database (docs/operations.md, "Faults and what the daemon does"):

- `instance.json`: the instance id, written once when the state is first initialised (after
  the same id is committed and checkpointed into the database), atomically and fsynced. It
  says "this directory has had state", and which database it belongs to.
- `journal-high-water`: the highest journal seq known committed, rewritten in place after
  each commit that journals events. Written only after the commit, it never exceeds what the
  database holds, unless the database lost commits (a deleted hot `-wal`, a restored older
  copy, a power loss with synchronous=NORMAL).
- the spool directory: output of commands that only ever exist after a bootstrap; a
  directory without instance.json and without a database, but with spooled output, has lost
  its database (the case of a state directory from before instance.json existed).

Decisions are plain functions over what the files and the database say; the store opens the
files and the database and calls them (`StateStore.open`).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path
from typing import NamedTuple

from sandbox_supervisor.daemon.state.fsutil import fsync_directory

INSTANCE_FILE = "instance.json"
HIGH_WATER_FILE = "journal-high-water"
# runtime/spool.py's SPOOL_DIRECTORY (tests/test_state_integrity.py holds them equal): the
# state layer may not import the runtime.
SPOOL_DIRECTORY = "spool"
# Where `reset-state` moves a refused state: `<state_dir>/damaged-<UTC time>/`.
DAMAGED_PREFIX = "damaged-"
# The database's own files, moved aside together (a -wal without its database must never be
# applied to a new one).
DB_SUFFIXES = ("", "-wal", "-shm", "-journal")
_FILE_MODE = 0o600
# The high-water mark is rewritten in place with one pwrite of this fixed width, so a reader
# never sees a torn or shorter number (20 digits hold any int64 seq).
HIGH_WATER_WIDTH = 20
# quick_check stops after this many problems: one is enough to refuse, a few help a human.
QUICK_CHECK_MAX_ERRORS = 5
_INSTANCE_ID = re.compile(r"[0-9a-f]{32}")

MISSING = "state_missing"
DAMAGED = "state_damaged"
INCONSISTENT = "state_inconsistent"

RESET_COMMAND = "sandbox-supervisor reset-state"


class StateRefused(Exception):
    """The state is missing, damaged or inconsistent: the daemon must not start on it
    (exit 2). `problem` is one of MISSING, DAMAGED, INCONSISTENT; `detail` says what was
    found; `action` what the operator can do."""

    def __init__(self, problem: str, detail: str, state_dir: Path) -> None:
        super().__init__(f"{problem}: {detail}")
        self.problem = problem
        self.detail = detail
        self.action = (
            f"restore {state_dir} from a backup, or start this sandbox's state afresh with "
            f"`{RESET_COMMAND} --state-dir {state_dir}` (it moves the refused state aside, "
            "into a damaged-* directory, and the next start initialises a new state; the "
            "control plane must then treat the sandbox as new)"
        )


class Marker(NamedTuple):
    instance_id: str
    created_at: float


def new_instance_id() -> str:
    return os.urandom(16).hex()


def read_marker(state_dir: Path) -> Marker | None:
    """instance.json, None when there is none; StateRefused when it cannot be read."""
    path = state_dir / INSTANCE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateRefused(DAMAGED, f"cannot read {path}: {exc.strerror}", state_dir) from None
    try:
        document = json.loads(text)
        marker = Marker(str(document["instance_id"]), float(document["created_at"]))
    except (ValueError, KeyError, TypeError):
        raise StateRefused(DAMAGED, f"{path} is not a valid instance record", state_dir) from None
    if not _INSTANCE_ID.fullmatch(marker.instance_id):
        raise StateRefused(DAMAGED, f"{path} holds no valid instance id", state_dir)
    return marker


def write_marker(state_dir: Path, marker: Marker) -> None:
    """Write instance.json atomically and durably (fsync the file, rename, fsync the
    directory): once this returns, the directory says it has had state, even after a power
    loss."""
    path = state_dir / INSTANCE_FILE
    temporary = state_dir / f".{INSTANCE_FILE}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(marker._asdict(), sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    fsync_directory(state_dir)


def has_spooled_output(state_dir: Path) -> bool:
    """Whether any command's output is spooled: evidence of a bootstrapped sandbox."""
    try:
        with os.scandir(state_dir / SPOOL_DIRECTORY) as entries:
            return any(entry.is_dir(follow_symlinks=False) for entry in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False


def check_before_open(state_dir: Path, db_path: Path, marker: Marker | None) -> None:
    """Refuse, before sqlite creates or touches anything, a database that is gone while the
    directory says it had one. (A deleted database beside a leftover -wal must never be
    opened: sqlite could apply the old -wal to the new file.)"""
    try:
        size = db_path.stat().st_size
    except FileNotFoundError:
        size = None
    if marker is not None:
        if size is None:
            raise StateRefused(
                MISSING, f"{db_path} does not exist, but {INSTANCE_FILE} says this sandbox had state", state_dir
            )
        if size == 0:
            raise StateRefused(
                MISSING, f"{db_path} is empty (0 bytes), but {INSTANCE_FILE} says this sandbox had state", state_dir
            )
    elif not size and has_spooled_output(state_dir):
        raise StateRefused(
            MISSING,
            f"{db_path} is {'missing' if size is None else 'empty'}, but {state_dir / SPOOL_DIRECTORY}"
            " holds commands' output, so this sandbox had state",
            state_dir,
        )


def quick_check(conn: sqlite3.Connection, state_dir: Path) -> None:
    """PRAGMA quick_check: every page of every table and index is read and its b-tree
    structure checked (O(size of the database), docs/operations.md gives the cost)."""
    try:
        rows = conn.execute(f"PRAGMA quick_check({QUICK_CHECK_MAX_ERRORS})").fetchall()
    except sqlite3.DatabaseError as exc:
        raise StateRefused(DAMAGED, f"the database cannot be checked: {exc}", state_dir) from None
    problems = [str(row[0]) for row in rows]
    if problems != ["ok"]:
        raise StateRefused(DAMAGED, "sqlite quick_check found: " + "; ".join(problems), state_dir)


def check_instance(
    state_dir: Path,
    marker: Marker | None,
    db_instance: str | None,
    db_last_seq: int,
    db_has_state: bool,
    high_water: int,
) -> None:
    """Refuse a database that is not the one instance.json (and the high-water mark) belong to.

    `db_instance`: the id the database records (None: none yet); `db_has_state`: whether it
    holds anything a bootstrap leaves (a binding, an event)."""
    if db_last_seq < high_water:
        raise StateRefused(
            INCONSISTENT,
            f"the journal ends at seq {db_last_seq}, but seq {high_water} was committed before"
            f" ({HIGH_WATER_FILE}): committed transactions were lost (a deleted -wal, an older"
            " copy of the database, or a power loss)",
            state_dir,
        )
    if marker is None:
        # No marker: a new directory (initialise), or one from before instance.json existed
        # or whose instance.json was deleted (adopt the database as it is). An empty database
        # with spooled output beside it lost its contents (check_before_open refused the
        # missing and 0-byte cases already).
        if db_instance is None and not db_has_state and has_spooled_output(state_dir):
            raise StateRefused(
                MISSING,
                f"the database holds no state, but {state_dir / SPOOL_DIRECTORY} holds commands'"
                " output, so this sandbox had state",
                state_dir,
            )
        return
    if db_instance is None:
        raise StateRefused(
            INCONSISTENT,
            f"the database records no instance id, but {INSTANCE_FILE} names {marker.instance_id}:"
            " the database was replaced or re-created",
            state_dir,
        )
    if db_instance != marker.instance_id:
        raise StateRefused(
            INCONSISTENT,
            f"the database belongs to instance {db_instance}, but {INSTANCE_FILE} names"
            f" {marker.instance_id}: the database was replaced",
            state_dir,
        )


class HighWater:
    """`journal-high-water`: the highest committed seq, rewritten in place (one pwrite of a
    fixed width, no fsync: it must survive a kill of the daemon, which the page cache does;
    after a power loss it may be behind, or ahead of a database that lost its last commits,
    which is the loss it exists to reveal)."""

    def __init__(self, fd: int, value: int) -> None:
        self._fd = fd
        self.value = value

    @staticmethod
    def read(state_dir: Path) -> int:
        """The recorded mark; 0 when there is none. StateRefused when it is unreadable."""
        path = state_dir / HIGH_WATER_FILE
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            raise StateRefused(DAMAGED, f"cannot read {path}: {exc}", state_dir) from None
        try:
            return int(text.strip() or "0")
        except ValueError:
            raise StateRefused(DAMAGED, f"{path} does not hold a seq", state_dir) from None

    @classmethod
    def open(cls, state_dir: Path, value: int) -> HighWater:
        fd = os.open(state_dir / HIGH_WATER_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
        mark = cls(fd, -1)
        try:
            mark.record(value)
        except BaseException:
            os.close(fd)
            raise
        return mark

    def record(self, seq: int) -> None:
        """Raise the mark to `seq`, once it is committed. An error is left to the caller: the
        commit stands, and a mark left behind only weakens the check, never fails it."""
        if seq <= self.value:
            return
        os.pwrite(self._fd, f"{seq:0{HIGH_WATER_WIDTH}d}\n".encode("ascii"), 0)
        self.value = seq

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def reset_stamp(now: float) -> str:
    """The damaged-* directory's name part: UTC time to the microsecond, sortable."""
    import datetime

    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def move_aside(state_dir: Path, db_name: str, stamp: str) -> Path | None:
    """Move the refused state (the database and its -wal/-shm, instance.json, the high-water
    mark, the spool) into `<state_dir>/damaged-<stamp>/`, never deleting anything; None when
    there was nothing to move. The spool goes too: it is the old instance's output (kept for
    whoever investigates), and left in place it would be evidence of lost state again.
    Durable: both directories are fsynced after the renames."""
    names = [f"{db_name}{suffix}" for suffix in DB_SUFFIXES] + [INSTANCE_FILE, HIGH_WATER_FILE, SPOOL_DIRECTORY]
    present = [name for name in names if os.path.lexists(state_dir / name)]
    if not present:
        return None
    target = state_dir / f"{DAMAGED_PREFIX}{stamp}"
    target.mkdir(mode=0o700)
    for name in present:
        os.replace(state_dir / name, target / name)
    fsync_directory(target)
    fsync_directory(state_dir)
    return target
