"""Durable state in one sqlite file: fence, binding, jti replay cache, journal, idempotency.

The API is synchronous on purpose: each method is one short transaction, so the daemon can
decide from what it read (the gate: `upgrade_state`) and record the outcome without an
`await` in between (the gate's decide-and-record stays atomic without locks). WAL with
synchronous=NORMAL makes every committed transaction survive a `kill -9` of the process
(docs/protocol.md §9).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

import structlog

from sandbox_supervisor.protocol.fencing import fence_admits
from sandbox_supervisor.protocol.frames import EXEC_STARTED, TOOL_RESULT, encode_event
from sandbox_supervisor.daemon.state import integrity
from sandbox_supervisor.daemon.state.fsutil import disk_full
from sandbox_supervisor.daemon.state.integrity import HighWater, Marker, StateRefused
from sandbox_supervisor.daemon.state.keys import LEGACY_SPACE, OWNER_SPACE, CallKey
from sandbox_supervisor.daemon.state.upgrade_state import UpgradeState
from sandbox_supervisor.daemon.state.visibility import EventView, default_view, event_view

log = structlog.get_logger("supervisor")

DB_FILENAME = "supervisor.sqlite3"
STATE_DIR_MODE = 0o700
DB_FILE_MODE = 0o600
# Long enough to ride out a checkpoint by another connection, short enough that a wedged
# database surfaces as an error (state_unavailable) instead of a hung daemon.
BUSY_TIMEOUT_S = 5.0
SCHEMA_VERSION = 9

# Space given back after pruning (docs/operations.md, "Disk use of the state directory"): the
# database is in incremental auto-vacuum mode, and free pages are returned to the file system
# in steps of this many pages (4 KiB each: 1 MiB), each its own short write transaction
# (about 2-10 ms here), so the event loop never stalls on a large give-back.
VACUUM_STEP_PAGES = 256
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL
# Process records waiting for the next write transaction to delete them (forget_process_soon):
# one statement takes them all, so the bound keeps it well under sqlite's limit of bound
# variables even when write transactions keep failing.
MAX_FORGOTTEN_PENDING = 1024
# The WAL file is cut back to this size when a checkpoint resets it; without a limit it stays
# at its largest size ever (a burst of output, a large give-back) for the daemon's life.
JOURNAL_SIZE_LIMIT_BYTES = 16 * 1024 * 1024

# Retention of completed idempotency records (docs/protocol.md §8): a key is remembered for
# this long after its call completed …
DEFAULT_CALL_MAX_AGE_S = 24 * 3600.0
# … and while the stored result frames of all completed records together stay within this
# many bytes; past it the oldest are forgotten first. Every keyed call stores its whole
# tool.result, so without a bound a read-only holder could fill the disk with keyed reads.
DEFAULT_CALL_MAX_RESULT_BYTES = 256 * 1024 * 1024

# The journal's bound (config [journal] max_unacked_bytes): past this many bytes of events the
# client has not acked, new tool calls are refused until it acks. A peer that calls but never
# reads grows the journal by tens of MiB a minute; this caps it near the spool and retention
# budgets, and is far above what a client that acks as it reads ever leaves unacked.
DEFAULT_MAX_UNACKED_BYTES = 256 * 1024 * 1024

# Above every seq (they are at most 2^53 - 1, docs/protocol.md §9).
MAX_SEQ = 2**63 - 1

# meta keys
META_FENCE_GENERATION = "fence_generation"
META_FENCE_ATTEMPT_ID = "fence_attempt_id"
META_TERMINATED = "terminated"
META_ACK_FLOOR = "ack_floor"
# The last seq ever assigned. Seqs come from here, never from max(seq), so they stay dense and
# are never reused after pruning or a restart.
META_LAST_SEQ = "last_seq"
# The bytes of result_frame over all completed idempotency records, kept in the transaction
# that changes them, so the size budget is checked without a SUM over the table per call.
META_CALL_RESULT_BYTES = "call_result_bytes"
# The instance id instance.json names (state/integrity.py): which database the directory's
# evidence belongs to. Written once, when the state is first initialised.
META_INSTANCE_ID = "instance_id"
# A row that only ever exists inside the transaction that starts the WAL (StateStore._start_wal).
_META_WAL_START = "wal_start"
# sqlite's result codes (and their extended forms) for a file that is not, or no longer, a
# sound database.
_CORRUPTION_CODES = ("SQLITE_CORRUPT", "SQLITE_NOTADB")

# Process groups started for shell commands, kept until the group is gone, so that a
# restarted daemon can kill what a crashed one left behind (docs/protocol.md §10.2).
_PROCESSES_TABLE = """CREATE TABLE IF NOT EXISTS processes (
            call_id TEXT PRIMARY KEY,
            pid INTEGER NOT NULL,
            pgid INTEGER NOT NULL,
            start_ticks INTEGER NOT NULL,
            recorded_at REAL NOT NULL)"""

# Each entry migrates the schema from version (index) to version (index + 1): SQL, or a
# function for a step SQL cannot say.
_MIGRATIONS: tuple[tuple[str | Callable[[sqlite3.Connection], None], ...], ...] = (
    (
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE binding (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            session_id TEXT NOT NULL,
            digest TEXT NOT NULL,
            body_json TEXT NOT NULL,
            bound_at REAL NOT NULL)""",
        "CREATE TABLE jti (jti TEXT PRIMARY KEY, expires_at REAL NOT NULL)",
        "CREATE INDEX jti_expires_at ON jti (expires_at)",
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY,
            kind TEXT NOT NULL,
            body_json TEXT NOT NULL,
            frame_json TEXT NOT NULL,
            created_at REAL NOT NULL)""",
        """CREATE TABLE idempotency (
            key TEXT PRIMARY KEY,
            tool_name TEXT NOT NULL,
            digest TEXT NOT NULL,
            call_id TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('pending', 'completed')),
            result_seq INTEGER,
            result_frame TEXT,
            intent_json TEXT,
            created_at REAL NOT NULL,
            completed_at REAL)""",
        _PROCESSES_TABLE,
        "CREATE INDEX idempotency_pending ON idempotency (state) WHERE state = 'pending'",
    ),
    (
        # Version 1 kept every event's body twice (body_json beside the frame_json that
        # holds it), doubling what each event writes to the WAL; nothing read body_json.
        # Rebuilt rather than ALTER TABLE … DROP COLUMN, which needs sqlite 3.35 (Debian
        # 11 ships 3.34).
        """CREATE TABLE events_v2 (
            seq INTEGER PRIMARY KEY,
            kind TEXT NOT NULL,
            frame_json TEXT NOT NULL,
            created_at REAL NOT NULL)""",
        "INSERT INTO events_v2 (seq, kind, frame_json, created_at)"
        " SELECT seq, kind, frame_json, created_at FROM events",
        "DROP TABLE events",
        "ALTER TABLE events_v2 RENAME TO events",
        # Unreleased builds wrote version 1 before the processes table existed.
        _PROCESSES_TABLE,
    ),
    (
        # Retention of completed records (docs/protocol.md §8): each record's result size,
        # an index to find the oldest completed ones, and the running total of result bytes.
        "ALTER TABLE idempotency ADD COLUMN result_bytes INTEGER",
        "UPDATE idempotency SET result_bytes = length(CAST(result_frame AS BLOB))"
        " WHERE result_frame IS NOT NULL",
        "CREATE INDEX idempotency_completed ON idempotency (completed_at)"
        " WHERE state = 'completed'",
        f"INSERT INTO meta (key, value) SELECT '{META_CALL_RESULT_BYTES}',"
        " CAST(COALESCE(SUM(result_bytes), 0) AS TEXT) FROM idempotency"
        " WHERE state = 'completed'",
    ),
    (
        # Who may see each event (docs/protocol.md §9.1): the scope it needs and the real
        # path a file tool touched. Existing rows get theirs from what they say (below).
        "ALTER TABLE events ADD COLUMN scope TEXT",
        "ALTER TABLE events ADD COLUMN path TEXT",
        "ALTER TABLE events ADD COLUMN commands TEXT",
        # A result is stored once (docs/protocol.md §8): a completed record points at its
        # tool.result event, which acks no longer delete while the record lives. Results
        # whose event an ack already pruned go back into the journal under their own seq
        # (below the ack floor, so no replay sends them again).
        "INSERT INTO events (seq, kind, frame_json, created_at)"
        f" SELECT result_seq, '{TOOL_RESULT}', result_frame, completed_at FROM idempotency"
        " WHERE state = 'completed' AND result_frame IS NOT NULL"
        " AND result_seq NOT IN (SELECT seq FROM events)",
        lambda conn: _set_default_views(conn),
        # Rebuilt without result_frame (DROP COLUMN needs sqlite 3.35).
        """CREATE TABLE idempotency_v4 (
            key TEXT PRIMARY KEY,
            tool_name TEXT NOT NULL,
            digest TEXT NOT NULL,
            call_id TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('pending', 'completed')),
            result_seq INTEGER,
            intent_json TEXT,
            created_at REAL NOT NULL,
            completed_at REAL,
            result_bytes INTEGER)""",
        "INSERT INTO idempotency_v4 (key, tool_name, digest, call_id, state, result_seq,"
        " intent_json, created_at, completed_at, result_bytes)"
        " SELECT key, tool_name, digest, call_id, state, result_seq, intent_json, created_at,"
        " completed_at, result_bytes FROM idempotency",
        "DROP TABLE idempotency",
        "ALTER TABLE idempotency_v4 RENAME TO idempotency",
        "CREATE INDEX idempotency_pending ON idempotency (state) WHERE state = 'pending'",
        "CREATE INDEX idempotency_completed ON idempotency (completed_at)"
        " WHERE state = 'completed'",
        # An ack prunes every event at or below the floor that no record points at.
        "CREATE INDEX idempotency_result_seq ON idempotency (result_seq)"
        " WHERE result_seq IS NOT NULL",
    ),
    (
        # Key spaces (docs/protocol.md §8, keys.py): a key is unique within its space, and
        # delegated spaces are pruned before the owner's, each walk on its own partial index.
        # Whose each existing record was is not recorded (a delegated socket's or the control
        # plane's): they go to the legacy space, which every space's lookup also finds, so a
        # retry after the upgrade is answered from its record whoever sends it.
        """CREATE TABLE idempotency_v5 (
            space TEXT NOT NULL,
            key TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            digest TEXT NOT NULL,
            call_id TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('pending', 'completed')),
            result_seq INTEGER,
            intent_json TEXT,
            created_at REAL NOT NULL,
            completed_at REAL,
            result_bytes INTEGER,
            -- key first: the owner's prune walk (space = '') must not look like a prefix
            -- of this index, or it would be chosen over the partial one and sort.
            PRIMARY KEY (key, space))""",
        "INSERT INTO idempotency_v5 (space, key, tool_name, digest, call_id, state, result_seq,"
        " intent_json, created_at, completed_at, result_bytes)"
        f" SELECT '{LEGACY_SPACE}', key, tool_name, digest, call_id, state, result_seq,"
        " intent_json, created_at, completed_at, result_bytes FROM idempotency",
        "DROP TABLE idempotency",
        "ALTER TABLE idempotency_v5 RENAME TO idempotency",
        "CREATE INDEX idempotency_pending ON idempotency (state) WHERE state = 'pending'",
        f"CREATE INDEX idempotency_owner_completed ON idempotency (completed_at)"
        f" WHERE state = 'completed' AND space = '{OWNER_SPACE}'",
        f"CREATE INDEX idempotency_delegated_completed ON idempotency (completed_at)"
        f" WHERE state = 'completed' AND space != '{OWNER_SPACE}'",
        "CREATE INDEX idempotency_result_seq ON idempotency (result_seq)"
        " WHERE result_seq IS NOT NULL",
    ),
    (
        # Processes kept by a holder (runtime/held.py, docs/protocol.md §7.7): what a restarted
        # daemon needs to adopt each one (the holder's identity) and to resume its live
        # events where the last daemon stopped (`*_sent`, moved in the transaction that
        # journals the events), and, once ended, its exit for exec.list (`exit_json`, set in
        # the transaction that journals exec.completed: reported exactly once).
        """CREATE TABLE held (
            call_id TEXT PRIMARY KEY,
            tool_name TEXT NOT NULL,
            command TEXT NOT NULL,
            pty INTEGER NOT NULL,
            pid INTEGER NOT NULL,
            pgid INTEGER NOT NULL,
            start_ticks INTEGER NOT NULL,
            holder_pid INTEGER NOT NULL,
            holder_start_ticks INTEGER NOT NULL,
            started_at REAL NOT NULL,
            origin TEXT,
            context_json TEXT NOT NULL,
            stdout_sent INTEGER NOT NULL DEFAULT 0,
            stderr_sent INTEGER NOT NULL DEFAULT 0,
            exit_json TEXT,
            ended_at REAL)""",
        "CREATE INDEX held_ended ON held (ended_at) WHERE ended_at IS NOT NULL",
    ),
    # Schema 7 changes no table: an append no longer writes meta.last_seq (the last seq is
    # the larger of it and the events' max(seq), _last_seq_in). A daemon of an earlier
    # release would take the stale meta value for the last seq and fail every append on a
    # seq already used; with the version raised it refuses the database at start instead.
    (),
    # A command's cgroup may be one made ahead (runtime/ready_cgroups.py), named apart from
    # its call_id: the record keeps the name, for a restart to adopt and keep it. NULL (a
    # record of an earlier release): the cgroup is named after the call_id.
    ("ALTER TABLE processes ADD COLUMN cgroup TEXT",),
    # A held process's cgroup may be one made ahead too (process_host.py), named apart from
    # its call_id: the same rule for the `held` record.
    ("ALTER TABLE held ADD COLUMN cgroup TEXT",),
)
assert len(_MIGRATIONS) == SCHEMA_VERSION

# Ended held processes kept for exec.list: the most recent ones (docs/protocol.md §7.7.4).
MAX_ENDED_HELD = 64


def _set_default_views(conn: sqlite3.Connection) -> None:
    """Views for events journaled before views existed: from what each event says. A file
    tool's result gets an unknown path (shown only to sockets without allowed_paths)."""
    updates = []
    for seq, kind, frame in conn.execute("SELECT seq, kind, frame_json FROM events WHERE scope IS NULL"):
        body = json.loads(frame).get("body") or {}
        error = body.get("error") or {}
        view = default_view(kind, body.get("tool_name"), error.get("code"))
        updates.append((view.scope, view.path, seq))
    conn.executemany("UPDATE events SET scope = ?, path = ? WHERE seq = ?", updates)


class StoreError(Exception):
    """The state could not be read or written: a fault of the database or the disk (the gate
    answers 500 state_unavailable, a frame gets `internal`)."""


class StoreFull(StoreError):
    """The write failed because the state directory's file system is full (SQLITE_FULL, or
    sqlite could not grow its shared-memory index): a passing fault, gone once space is freed.
    Callers that can wait answer it with a retry rather than an error (docs/operations.md,
    "Faults and what the daemon does")."""


def store_error(message: str, exc: BaseException) -> StoreError:
    """The StoreError for `exc`: StoreFull when it says the disk is full (fsutil.disk_full)."""
    return (StoreFull if disk_full(exc) else StoreError)(f"{message}: {exc}")


class StoreRefusal(Exception):
    """The store refused a write its rules forbid; nothing changed. Never a fault, and so
    never a StoreError: a refusal must not turn into a 500 or an `internal`."""


class JtiReplayed(StoreRefusal):
    """The assertion's jti is already in the replay cache."""


class FenceRegressed(StoreRefusal):
    """An upgrade would lower the fence; the gate should have answered stale_generation."""


class AlreadyBound(StoreRefusal):
    """bind() on a supervisor that is already bound (it serves one session for its life)."""


class AckAhead(StoreRefusal):
    """An ack above the highest journaled seq: the floor may never pass the journal."""


@dataclass(frozen=True, slots=True)
class Terminated:
    code: str
    message: str
    at: float


@dataclass(frozen=True, slots=True)
class Binding:
    session_id: str
    digest: str
    body_json: str
    bound_at: float


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    terminated: Terminated | None
    bound_session_id: str | None
    binding_digest: str | None
    fence_generation: int  # 0 = no upgrade accepted yet
    fence_attempt_id: str | None
    local_event_max: int
    ack_floor: int
    oldest_retained_seq: int  # local_event_max + 1 when nothing is retained


@dataclass(frozen=True, slots=True)
class CallRetention:
    """How long completed idempotency records are kept (config section [idempotency]).
    Pending records are never pruned: crash recovery needs every one of them."""

    max_age_s: float = DEFAULT_CALL_MAX_AGE_S
    max_result_bytes: int = DEFAULT_CALL_MAX_RESULT_BYTES

    def __post_init__(self) -> None:
        if not (self.max_age_s > 0 and self.max_result_bytes > 0):
            raise ValueError("call retention limits must be positive")


class RecordedProcess(NamedTuple):
    """A command's process group as recorded when it started (`start_process`)."""

    call_id: str
    pid: int
    pgid: int
    start_ticks: int
    cgroup: str  # its cgroup's name: a ready one's (runtime/ready_cgroups.py), or the call_id


class JournalRow(NamedTuple):
    """One journaled event as stored: its seq, its frame text (what is sent), and who may see
    it (docs/protocol.md §9.1)."""

    seq: int
    frame: str
    view: EventView


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One idempotency record (docs/protocol.md §8)."""

    space: str  # keys.py: whose key it is
    key: str  # as the client sent it
    tool_name: str
    digest: str
    call_id: str
    state: str  # "pending" | "completed"
    result_seq: int | None
    # The tool.result event exactly as journaled, and who may see it: read from the journal
    # row the record points at (kept past acks while the record lives, so stored once).
    result_frame: str | None
    result_view: EventView | None
    intent_json: str | None

    @property
    def call_key(self) -> CallKey:
        return CallKey(self.space, self.key)


# The prune walks (one per side of the key-space split, keys.py), each on its own partial index:
# delegated spaces first, then the owner's.
PRUNE_WALKS = tuple(
    "SELECT space, key, completed_at, result_bytes, result_seq FROM idempotency"
    f" WHERE state = 'completed' AND space {op} '{OWNER_SPACE}' ORDER BY completed_at"
    for op in ("!=", "=")
)

@dataclass(frozen=True, slots=True)
class HeldRecord:
    """A process kept by a holder, as recorded (table `held`)."""

    call_id: str
    tool_name: str
    command: str
    pty: bool
    pid: int
    pgid: int
    start_ticks: int
    holder_pid: int
    holder_start_ticks: int
    started_at: float
    origin: str | None  # commands_origin of the allowed_commands it runs under (§9.1)
    context_json: str  # exec.started's context
    sent: dict[str, int] = field(default_factory=dict)  # stream -> live events journaled up to
    exit_json: str | None = None  # set once its exec.completed is journaled
    ended_at: float | None = None
    # Its cgroup's name when that is not its call_id (one made ahead, runtime/ready_cgroups.py):
    # what a restart adopts and keeps. None: named after the call_id, or no cgroup.
    cgroup: str | None = None

    @property
    def cgroup_name(self) -> str:
        """The name of its cgroup, were there cgroups."""
        return self.cgroup or self.call_id


_HELD_COLUMNS = (
    "call_id, tool_name, command, pty, pid, pgid, start_ticks, holder_pid, holder_start_ticks,"
    " started_at, origin, context_json, stdout_sent, stderr_sent, exit_json, ended_at, cgroup"
)


def _held_record(row: Sequence[Any]) -> HeldRecord:
    (call_id, tool_name, command, pty, pid, pgid, start_ticks, holder_pid, holder_start_ticks,
     started_at, origin, context_json, stdout_sent, stderr_sent, exit_json, ended_at, cgroup) = row
    return HeldRecord(
        call_id, tool_name, command, bool(pty), pid, pgid, start_ticks, holder_pid, holder_start_ticks,
        started_at, origin, context_json, {"stdout": stdout_sent, "stderr": stderr_sent}, exit_json, ended_at,
        cgroup,
    )


# A record joined with the event that holds its result.
_CALL_SELECT = (
    "SELECT i.space, i.key, i.tool_name, i.digest, i.call_id, i.state, i.result_seq, e.frame_json,"
    " e.scope, e.path, e.commands, i.intent_json, i.completed_at, i.result_bytes"
    " FROM idempotency AS i LEFT JOIN events AS e ON e.seq = i.result_seq"
)


def _call_record(row: Sequence[Any]) -> CallRecord:
    space, key, tool_name, digest, call_id, state, result_seq, frame, scope, path, commands, intent = row[:12]
    view = EventView(scope, path, commands) if frame is not None else None
    return CallRecord(space, key, tool_name, digest, call_id, state, result_seq, frame, view, intent)


class StateStore:
    """One connection to `<state_dir>/supervisor.sqlite3`; every public method is one
    transaction. Safe to call from one thread at a time, whichever thread that is."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path, retention: CallRetention = CallRetention()
    ) -> None:
        self._conn = conn
        self.path = path
        self.retention = retention
        # Serialises callers if the daemon moves calls to worker threads (trio.to_thread);
        # uncontended when everything runs on the trio thread.
        self._lock = threading.RLock()  # re-entry is caught as nesting, not a deadlock
        self._closed = False
        # The journal's high-water mark outside the database (state/integrity.py), raised
        # after each commit that journals events; None for a store not opened by `open`.
        self._high_water: HighWater | None = None
        # Set when the mark's file could not be written at open (a full disk): opened again
        # at the next commit that journals events, so once there is room the mark follows
        # the commits again without a restart (the daemon recovers from a full disk by
        # itself).
        self._high_water_dir: Path | None = None
        self._journaled_through: int | None = None  # set by an append, recorded at commit
        # Process records to delete with the next write transaction (forget_process_soon).
        self._forgotten: set[str] = set()
        # The last seq ever assigned, as committed: kept here rather than read and written in
        # `meta` by every append (two statements and a page of each event's commit). This
        # store is the database's only writer, so the value cannot change behind it; it is
        # loaded from the database by the first transaction that needs it (_last_seq_in) and
        # moves only once a commit that journaled events has succeeded (_transaction).
        self._last_seq: int | None = None
        # The binding, once read or written: it is written once (`bind`, an INSERT that
        # refuses a second one) and never changed or deleted while the store is open, so
        # every upgrade and bootstrap after the first reads it from here. _UNREAD until a
        # transaction has seen it, and again after any failed transaction (a failed `bind`'s
        # COMMIT may have landed).
        self._binding: Binding | None | _Unread = _UNREAD

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path, retention: CallRetention = CallRetention()) -> StateStore:
        """Open (creating if needed) the state directory, the database file and its schema;
        completed idempotency records past `retention` are pruned at once (limits lowered
        across a restart apply from the start).

        The state is checked first (state/integrity.py): StateRefused when it is missing
        (instance.json or spooled output say there was a database, and there is none or an
        empty one), damaged (sqlite's quick_check fails, or the file is not a database) or
        inconsistent (the database is another instance's, or older than the journal's
        high-water mark). A directory with none of that evidence is initialised."""
        state_dir = Path(state_dir)
        path = state_dir / DB_FILENAME
        try:
            if not state_dir.exists():
                state_dir.mkdir(parents=True, mode=STATE_DIR_MODE)
                # mkdir's mode is filtered by the umask; the daemon's directory is 0700 exactly.
                os.chmod(state_dir, STATE_DIR_MODE)
        except OSError as exc:
            raise store_error(f"cannot create the state directory {state_dir}", exc) from exc
        # Before sqlite creates or opens anything: a deleted database is never re-created.
        marker = integrity.read_marker(state_dir)
        integrity.check_before_open(state_dir, path, marker)
        high_water = HighWater.read(state_dir)
        try:
            # Create the file ourselves so it is 0600 from the first byte; sqlite gives the
            # -wal and -shm files the same permissions.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, DB_FILE_MODE))
            conn = sqlite3.connect(
                str(path),
                timeout=BUSY_TIMEOUT_S,  # sqlite's busy_timeout
                isolation_level=None,  # explicit BEGIN/COMMIT only
                check_same_thread=False,  # guarded by self._lock instead
            )
        except (OSError, sqlite3.Error) as exc:
            raise store_error(f"cannot open state database {path}", exc) from exc
        store = cls(conn, path, retention)
        try:
            try:
                store._configure()
                try:
                    integrity.quick_check(conn, state_dir)
                except sqlite3.Error as exc:  # only a full disk gets here (see quick_check)
                    raise store_error("cannot check the state database", exc) from exc
                store._migrate()
                last_seq = store._check_instance(state_dir, marker, high_water)
            except StoreError as exc:
                cause = exc.__cause__
                if isinstance(cause, sqlite3.DatabaseError) and str(getattr(cause, "sqlite_errorname", "")).startswith(_CORRUPTION_CODES):
                    raise StateRefused(integrity.DAMAGED, f"{path}: {cause}", state_dir) from None
                raise  # StoreFull among them: the caller waits for space, then all of this again
            # Only once the database is known to be this sandbox's, sound one: the conversion
            # rewrites the whole file.
            store._enable_incremental_vacuum()
            store.prune_calls()
            try:
                store._high_water = HighWater.open(state_dir, last_seq)
            except OSError:
                # A full disk, say: the daemon still starts. The mark stays where it was (at
                # or below what the database holds), which weakens the next start's check
                # and never makes it refuse this sound database; the next commit tries again.
                store._high_water = None
                store._high_water_dir = state_dir
            store._start_wal()
        except BaseException:
            conn.close()
            raise
        return store

    def _start_wal(self) -> None:
        """Commit one page now. The first commit into a new or just-reset WAL writes and fsyncs
        the WAL's header (synchronous=NORMAL syncs it once per WAL start): paid here, at start,
        instead of by the first client's upgrade, whose fence and jti commit before the 101.
        A row added and removed again leaves the page as it was, but dirty (sqlite skips an
        update that rewrites a row unchanged), so the commit writes it."""
        with self._transaction() as conn:
            conn.execute("INSERT INTO meta (key, value) VALUES (?, '')", (_META_WAL_START,))
            conn.execute("DELETE FROM meta WHERE key = ?", (_META_WAL_START,))

    def _check_instance(self, state_dir: Path, marker: Marker | None, high_water: int) -> int:
        """Compare the database with instance.json and the high-water mark (StateRefused when
        they disagree); give a new or adopted database its instance id, and write
        instance.json when it is missing. Returns the journal's last seq."""
        with self._transaction() as conn:
            meta = _read_meta(conn, META_INSTANCE_ID)
            last_seq = self._last_seq_in(conn)
            has_state = last_seq > 0 or conn.execute("SELECT 1 FROM binding").fetchone() is not None
            db_instance = meta.get(META_INSTANCE_ID)
            integrity.check_instance(state_dir, marker, db_instance, last_seq, has_state, high_water)
            if db_instance is None:
                db_instance = integrity.new_instance_id()
                _write_meta(conn, {META_INSTANCE_ID: db_instance})
        if marker is None:
            try:
                # Into the database file itself first, so a later loss of the -wal cannot take
                # the id with it (that loss is what the high-water mark reveals); then the
                # marker, durably. A crash in between leaves an id without a marker, which the
                # next start adopts (the database is the one that was here).
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                integrity.write_marker(state_dir, Marker(db_instance, time.time()))
            except (OSError, sqlite3.Error) as exc:
                # On a full disk StoreFull: the caller waits for space and opens again, which
                # adopts the id already committed and writes the marker then. Never a refusal
                # (the state is sound) and never a start without the marker (a database
                # deleted meanwhile would go unnoticed).
                raise store_error("cannot record the state's instance id", exc) from exc
        return last_seq

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self.flush_forgotten()
                except StoreError:
                    pass  # stale records: the next start drops them (forget_process_soon)
                self._closed = True
                self._conn.close()
                if self._high_water is not None:
                    self._high_water.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _configure(self) -> None:
        try:
            # Before anything creates the file's first page (WAL mode does): a new database
            # gets incremental auto-vacuum at no cost; an older one is converted once after
            # the migrations (_enable_incremental_vacuum). On an existing file this is a no-op.
            self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StoreError(f"sqlite refused WAL mode (got {mode!r})")
            # NORMAL in WAL mode: a commit survives a process kill (not a power loss), which
            # is the guarantee docs/protocol.md §9 gives, at a fraction of FULL's cost.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT_BYTES}")
        except sqlite3.Error as exc:
            raise store_error("cannot configure state database", exc) from exc

    def _migrate(self) -> None:
        with self._transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"state database schema {version} is newer than this supervisor's "
                    f"{SCHEMA_VERSION}"
                )
            if version == SCHEMA_VERSION:
                # Nothing to do, and nothing written: a start on a full disk must not fail
                # on a header rewrite that changes nothing.
                return
            for step in range(version, SCHEMA_VERSION):
                for statement in _MIGRATIONS[step]:
                    if callable(statement):
                        statement(conn)
                    else:
                        conn.execute(statement)
            # PRAGMA arguments cannot be bound parameters; the value is our own int.
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _enable_incremental_vacuum(self) -> None:
        """Convert a database created before incremental auto-vacuum, once: only a VACUUM
        can (it rewrites the file: about 1 s for 85 MB here, and needs that much free space).
        When it fails (a full disk) the daemon runs on without giving space back, and tries
        again at the next start."""
        conn = self._conn
        try:
            if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == AUTO_VACUUM_INCREMENTAL:
                return
            started = time.monotonic()
            conn.execute("VACUUM")
        except sqlite3.Error as exc:
            log.warning("state.vacuum_failed", error=str(exc))
            return
        log.info("state.vacuumed", duration_ms=round((time.monotonic() - started) * 1000, 3), bytes=self.path.stat().st_size)

    def free_pages(self) -> int:
        """Pages of the database file that hold nothing (freed by pruning)."""
        with self._lock:
            conn = self._open_connection()
            try:
                return int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            except sqlite3.Error as exc:
                raise store_error("cannot read the free page count", exc) from exc

    def give_back_pages(self, pages: int = VACUUM_STEP_PAGES) -> int:
        """Return up to `pages` free pages to the file system (one incremental-vacuum step, its
        own transaction); the free pages left. A database without incremental auto-vacuum
        returns none (the loop that calls this stops when nothing changes)."""
        with self._lock:
            conn = self._idle_connection()
            try:
                # executescript steps the pragma to its end: execute() would free one page.
                conn.executescript(f"PRAGMA incremental_vacuum({int(pages)});")
                return int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            except sqlite3.Error as exc:
                raise store_error("cannot give free pages back", exc) from exc

    def checkpoint(self) -> None:
        """Copy the WAL into the database without waiting for readers (PASSIVE): the file
        shrinks to what the vacuum left, and the WAL is cut back at its next reset."""
        with self._lock:
            conn = self._open_connection()
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:
                raise store_error("cannot checkpoint", exc) from exc

    def _open_connection(self) -> sqlite3.Connection:
        """The connection, under `_lock` (the caller holds it); StoreError once closed."""
        if self._closed:
            raise StoreError("state store is closed")
        return self._conn

    def _idle_connection(self) -> sqlite3.Connection:
        """The open connection with no transaction under way (the caller holds `_lock`):
        statements that run their own transaction never nest in another one."""
        conn = self._open_connection()
        if conn.in_transaction:
            raise StoreError("state store transactions do not nest")
        return conn

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction. Methods that must be atomic together (an idempotency row and its
        tool.result event) call the `_..._in(conn, …)` helpers inside a single one of these;
        transactions never nest."""
        with self._lock:
            conn = self._idle_connection()
            try:
                # IMMEDIATE takes the write lock up front, so a read-then-write in the block
                # cannot fail half way with SQLITE_BUSY; reads take a consistent snapshot.
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN DEFERRED")
            except sqlite3.Error as exc:
                raise store_error("cannot begin a transaction", exc) from exc
            self._journaled_through = None
            forgotten = tuple(self._forgotten) if write else ()
            try:
                if forgotten:
                    conn.execute(
                        f"DELETE FROM processes WHERE call_id IN ({','.join('?' * len(forgotten))})", forgotten
                    )
                yield conn
                conn.execute("COMMIT")
                self._forgotten.difference_update(forgotten)
                if self._journaled_through is not None:
                    self._last_seq = self._journaled_through
            except BaseException as exc:
                self._journaled_through = None
                # Read the last seq again from the database next time: a COMMIT that reported
                # an error may still have landed (or an exception came between it and the
                # line above), and a stale value would make every later append collide.
                self._last_seq = None
                # The binding too: a failed `bind` (its COMMIT may have landed) must not
                # leave "unbound" cached; it is read again when next asked for.
                self._binding = _UNREAD
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the original error is the one worth reporting
                if isinstance(exc, sqlite3.Error):
                    raise store_error("state database error", exc) from exc
                raise
            self._record_high_water()

    def _record_high_water(self) -> None:
        """After a commit that journaled events: raise the mark outside the database. A
        failure to write it is not the commit's (it stands): the mark stays behind, which
        weakens the start-up check and never makes it refuse a sound database."""
        seq, self._journaled_through = self._journaled_through, None
        if seq is None:
            return
        try:
            if self._high_water is not None:
                self._high_water.record(seq)
            elif self._high_water_dir is not None:
                self._high_water = HighWater.open(self._high_water_dir, seq)
                self._high_water_dir = None
        except OSError:
            pass

    # -- reads -----------------------------------------------------------------------------

    def snapshot(self) -> StateSnapshot:
        with self._transaction(write=False) as conn:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            bound = self._binding_in(conn)
            # Results that completed records still point at stay below the floor; they are
            # not retained for replay.
            oldest = conn.execute(
                "SELECT MIN(seq) FROM events WHERE seq > ?", (int(meta.get(META_ACK_FLOOR, 0)),)
            ).fetchone()[0]
            last_seq = self._last_seq_in(conn)
        terminated = None
        if META_TERMINATED in meta:
            data = json.loads(meta[META_TERMINATED])
            terminated = Terminated(code=data["code"], message=data["message"], at=data["at"])
        return StateSnapshot(
            terminated=terminated,
            bound_session_id=bound.session_id if bound else None,
            binding_digest=bound.digest if bound else None,
            fence_generation=int(meta.get(META_FENCE_GENERATION, 0)),
            fence_attempt_id=meta.get(META_FENCE_ATTEMPT_ID),
            local_event_max=last_seq,
            ack_floor=int(meta.get(META_ACK_FLOOR, 0)),
            oldest_retained_seq=oldest if oldest is not None else last_seq + 1,
        )

    def frame_bytes(self, after: int, through: int | None = None) -> int:
        """The UTF-8 bytes of the events with a seq above `after` (and up to `through`): the
        unacknowledged journal when `after` is the floor, what an ack covers otherwise."""
        with self._transaction(write=False) as conn:
            row = conn.execute(
                "SELECT COALESCE(SUM(length(CAST(frame_json AS BLOB))), 0) FROM events WHERE seq > ? AND seq <= ?",
                (after, MAX_SEQ if through is None else through),
            ).fetchone()
        return int(row[0])

    def upgrade_state(self, jti: str, now: float) -> UpgradeState:
        """The gate's facts in one read: the bound session, the local event max, the fence,
        and whether `jti` is in the replay cache and not yet expired (`jti_seen`)."""
        with self._transaction(write=False) as conn:
            meta = _read_meta(conn, META_FENCE_GENERATION, META_FENCE_ATTEMPT_ID)
            seen = conn.execute(
                "SELECT 1 FROM jti WHERE jti = ? AND expires_at > ?", (jti, now)
            ).fetchone() is not None
            last_seq = self._last_seq_in(conn)
            bound = self._binding_in(conn)
        return UpgradeState(
            bound_session_id=bound.session_id if bound else None,
            local_event_max=last_seq,
            fence_generation=int(meta.get(META_FENCE_GENERATION, 0)),
            fence_attempt_id=meta.get(META_FENCE_ATTEMPT_ID),
            jti_seen=seen,
        )

    def binding(self) -> Binding | None:
        if not isinstance(self._binding, _Unread) and not self._closed:
            return self._binding  # never changes once read: no transaction needed
        with self._transaction(write=False) as conn:
            return self._binding_in(conn)

    def _binding_in(self, conn: sqlite3.Connection) -> Binding | None:
        if isinstance(self._binding, _Unread):
            row = conn.execute(
                "SELECT session_id, digest, body_json, bound_at FROM binding WHERE id = 1"
            ).fetchone()
            self._binding = Binding(*row) if row else None
        return self._binding

    def events_after(self, seq: int, limit: int, max_chars: int | None = None) -> list[tuple[int, str]]:
        """Up to `limit` retained events with a seq above `seq`, in order: (seq, frame_json)."""
        return [(row.seq, row.frame) for row in self.rows_after(seq, limit, max_chars)]

    def rows_after(self, seq: int, limit: int, max_chars: int | None = None) -> list[JournalRow]:
        """Up to `limit` retained events with a seq above `seq` (and above the ack floor), in
        order. With `max_chars`, rows stop once that many characters are gathered (always at
        least one row): a batch of large frames is not read into memory all at once."""
        if limit <= 0:
            raise ValueError("limit must be positive")
        with self._transaction(write=False) as conn:
            cursor = conn.execute(
                "SELECT seq, frame_json, scope, path, commands FROM events WHERE seq > MAX(?, COALESCE("
                f"(SELECT CAST(value AS INTEGER) FROM meta WHERE key = '{META_ACK_FLOOR}'), 0))"
                " ORDER BY seq LIMIT ?",
                (seq, limit),
            )
            rows = (
                JournalRow(seq, frame, EventView(scope, path, commands))
                for seq, frame, scope, path, commands in cursor
            )
            if max_chars is None:
                return list(rows)
            return take_within(rows, max_chars)  # sqlite steps row by row: the rest is never read

    # -- writes ----------------------------------------------------------------------------

    def record_upgrade(
        self, *, generation: int, attempt_id: str, jti: str, jti_expires_at: float, now: float
    ) -> None:
        """Persist an accepted upgrade: the fence and the jti, in one transaction (docs/protocol.md §2.3).

        Raises JtiReplayed for a cached jti and FenceRegressed for a fence the gate should have
        refused; in both cases nothing changes.
        """
        if generation < 1:
            raise ValueError("generation must be at least 1")
        with self._transaction() as conn:
            # Forget expired jtis first, so a jti whose cache entry has lapsed is not refused.
            conn.execute("DELETE FROM jti WHERE expires_at <= ?", (now,))
            meta = _read_meta(conn, META_FENCE_GENERATION, META_FENCE_ATTEMPT_ID)
            fence = int(meta.get(META_FENCE_GENERATION, 0))
            if not fence_admits(generation, attempt_id, fence, meta.get(META_FENCE_ATTEMPT_ID)):
                raise FenceRegressed(
                    f"generation {generation} does not pass the fence at generation {fence}"
                )
            try:
                conn.execute(
                    "INSERT INTO jti (jti, expires_at) VALUES (?, ?)", (jti, jti_expires_at)
                )
            except sqlite3.IntegrityError:
                raise JtiReplayed("the assertion's jti was already used") from None
            _write_meta(
                conn,
                {META_FENCE_GENERATION: str(generation), META_FENCE_ATTEMPT_ID: attempt_id},
            )

    def bind(self, session_id: str, digest: str, body_json: str, now: float) -> None:
        """Bind the supervisor to its one session; AlreadyBound when a binding exists."""
        with self._lock:  # the commit and the cached binding, together
            with self._transaction() as conn:
                try:
                    conn.execute(
                        "INSERT INTO binding (id, session_id, digest, body_json, bound_at)"
                        " VALUES (1, ?, ?, ?, ?)",
                        (session_id, digest, body_json, now),
                    )
                except sqlite3.IntegrityError:
                    raise AlreadyBound("the supervisor is already bound") from None
            self._binding = Binding(session_id, digest, body_json, now)

    def mark_terminated(self, code: str, message: str, now: float) -> None:
        """Record the terminal state. The first reason is kept: it is the one that ended the
        supervisor, and a later call (a retry after a crash) must not rewrite history."""
        value = json.dumps({"code": code, "message": message, "at": now})
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (META_TERMINATED, value)
            )

    def raise_ack_floor(self, seq: int) -> int:
        """Raise the ack floor to `seq` (never lowers it); returns the floor now in force.
        AckAhead when `seq` is above the highest journaled seq. The events the floor newly
        covers are deleted in the same transaction: the floor moves if and only if they go,
        so a failed ack leaves nothing half done (and nothing below the floor is left but
        results that records keep)."""
        if seq < 0:
            raise ValueError("an ack seq cannot be negative")
        with self._transaction() as conn:
            meta = _read_meta(conn, META_ACK_FLOOR)
            last_seq = self._last_seq_in(conn)
            if seq > last_seq:
                raise AckAhead(f"ack {seq} is above the highest journaled seq {last_seq}")
            previous = int(meta.get(META_ACK_FLOOR, 0))
            floor = max(previous, seq)
            if floor > previous:
                # The events about to go may include the newest: `meta` keeps the last seq
                # from now on, so it is never assigned again (_last_seq_in).
                _write_meta(conn, {META_ACK_FLOOR: str(floor), META_LAST_SEQ: str(last_seq)})
                # Only the newly covered range: below the old floor is either already gone or
                # a result a completed record points at, which stays (stored once,
                # docs/protocol.md §8) until the record is forgotten; nothing replays it. So
                # an ack costs what it covers, not what records have kept over the day.
                conn.execute(
                    "DELETE FROM events WHERE seq > ? AND seq <= ? AND NOT EXISTS"
                    " (SELECT 1 FROM idempotency WHERE result_seq = events.seq)",
                    (previous, floor),
                )
        return floor

    def append_events(
        self, events: Sequence[tuple[str, dict[str, Any]]], *, origin: str | None = None, now: float | None = None
    ) -> list[JournalRow]:
        """Journal events with the next dense seqs, in one transaction; returns their rows,
        the frame exactly as stored (and to be sent). Views come from what each event says
        (`visibility.default_view`); `origin`: the allowed_commands a command's exec.* events
        ran under."""
        if not events:
            return []
        created_at = time.time() if now is None else now
        with self._transaction() as conn:
            return self._append_events_in(conn, events, created_at, origin=origin)

    # -- idempotency -----------------------------------------------------------------------

    def begin_call(
        self,
        *,
        key: CallKey,
        tool_name: str,
        digest: str,
        call_id: str,
        intent_json: str | None,
        now: float | None = None,
    ) -> CallRecord | None:
        """Claim `key` for a new execution: writes a pending record and returns None, or
        returns the existing record untouched. One transaction, so of two concurrent calls
        with the same key exactly one gets None."""
        created_at = time.time() if now is None else now
        with self._transaction() as conn:
            # Its own space first, then the legacy space (keys.py): one probe of the primary key.
            row = conn.execute(
                f"{_CALL_SELECT} WHERE i.key = ? AND i.space IN (?, ?) ORDER BY i.space = ? LIMIT 1",
                (key.key, key.space, LEGACY_SPACE, LEGACY_SPACE),
            ).fetchone()
            if row is not None:
                record = _call_record(row)
                completed_at, result_bytes = row[-2:]
                if not self._expired(record, completed_at, created_at):
                    return record
                # Past its retention but not pruned yet (pruning runs when calls complete):
                # forgotten now, so whether a key is remembered never depends on when the
                # last completion happened to prune.
                self._forget_completed_in(conn, [(record.call_key, result_bytes, record.result_seq)])
            conn.execute(
                "INSERT INTO idempotency (space, key, tool_name, digest, call_id, state,"
                " intent_json, created_at) VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
                (*key, tool_name, digest, call_id, intent_json, created_at),
            )
        return None

    def set_call_intent(self, key: CallKey, intent_json: str) -> None:
        """Record what a pending call is about to do (a patch's planned result) before it
        does it, so crash recovery can tell 'done' from 'not started'."""
        with self._transaction() as conn:
            updated = conn.execute(
                "UPDATE idempotency SET intent_json = ? WHERE space = ? AND key = ?"
                " AND state = 'pending'",
                (intent_json, *key),
            ).rowcount
        if updated != 1:
            raise StoreError(f"no pending call with key {key!r}")

    def complete_call(
        self,
        key: CallKey | None,
        result_body: dict[str, Any],
        *,
        preceding: Sequence[tuple[str, dict[str, Any]]] = (),
        view: EventView | None = None,
        origin: str | None = None,
        now: float | None = None,
    ) -> list[JournalRow]:
        """Journal a call's final events (`preceding`, e.g. exec.completed, then its
        tool.result with `view`, by default what it says) and, with a key, mark its record
        completed — one transaction, so a crash leaves either a pending record and no
        result, or both. The record points at its tool.result: the result is stored once."""
        created_at = time.time() if now is None else now
        with self._transaction() as conn:
            rows = self._append_events_in(
                conn, [*preceding, (TOOL_RESULT, result_body)], created_at, last_view=view, origin=origin
            )
            seq, frame, _ = rows[-1]
            if key is not None:
                size = len(frame.encode("utf-8"))
                updated = conn.execute(
                    "UPDATE idempotency SET state = 'completed', result_seq = ?,"
                    " result_bytes = ?, completed_at = ?"
                    " WHERE space = ? AND key = ? AND state = 'pending'",
                    (seq, size, created_at, *key),
                ).rowcount
                if updated != 1:
                    raise StoreError(f"no pending call with key {key!r}")
                total = _call_result_bytes(conn) + size
                _write_meta(conn, {META_CALL_RESULT_BYTES: str(total)})
                # Pruned in the completion's own transaction: the budget holds after every
                # commit, and the cost is one index seek unless something is due.
                self._prune_calls_in(conn, created_at, total)
        return rows

    def release_call(
        self, key: CallKey, result_body: dict[str, Any], *, view: EventView | None = None, now: float | None = None
    ) -> list[JournalRow]:
        """Journal the tool.result of a call refused before any side effect for a passing
        reason (too many processes, the daemon stopping) and free its key in the same
        transaction, so a retry with the same key can run later."""
        created_at = time.time() if now is None else now
        with self._transaction() as conn:
            rows = self._append_events_in(conn, [(TOOL_RESULT, result_body)], created_at, last_view=view)
            deleted = conn.execute(
                "DELETE FROM idempotency WHERE space = ? AND key = ? AND state = 'pending'", key
            ).rowcount
            if deleted != 1:
                raise StoreError(f"no pending call with key {key!r}")
        return rows

    def prune_calls(self, *, now: float | None = None) -> int:
        """Forget completed idempotency records past the retention (oldest first); returns
        how many. complete_call does this on every completion; this is for opening."""
        with self._transaction() as conn:
            return self._prune_calls_in(conn, time.time() if now is None else now)

    def call_result_bytes(self) -> int:
        """The bytes of stored result frames over all completed records (the budgeted sum)."""
        with self._transaction(write=False) as conn:
            return _call_result_bytes(conn)

    def call_record(self, key: CallKey) -> CallRecord | None:
        with self._transaction(write=False) as conn:
            row = conn.execute(f"{_CALL_SELECT} WHERE i.space = ? AND i.key = ?", key).fetchone()
        return _call_record(row) if row else None

    def pending_calls(self) -> list[CallRecord]:
        """Records left pending (by a crash), oldest first."""
        with self._transaction(write=False) as conn:
            rows = conn.execute(
                f"{_CALL_SELECT} WHERE i.state = 'pending' ORDER BY i.created_at, i.key"
            ).fetchall()
        return [_call_record(row) for row in rows]

    # -- process groups --------------------------------------------------------------------

    def start_process(
        self,
        call_id: str,
        pid: int,
        pgid: int,
        start_ticks: int,
        started_body: dict[str, Any],
        origin: str | None = None,
        cgroup: str | None = None,
    ) -> list[JournalRow]:
        """Record a spawned process group (for the clean-up after a crash) and journal its
        exec.started, in one transaction: a started command always has its record. `cgroup`:
        the name of its cgroup when that is not its call_id."""
        now = time.time()
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO processes (call_id, pid, pgid, start_ticks, recorded_at, cgroup)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (call_id, pid, pgid, start_ticks, now, cgroup),
            )
            return self._append_events_in(conn, [(EXEC_STARTED, started_body)], now, origin=origin)

    def forget_process(self, call_id: str) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM processes WHERE call_id = ?", (call_id,))

    def forget_process_soon(self, call_id: str) -> None:
        """Delete a group's record with the next write transaction: a finished command's
        result is committed right after (CallRunner._finish), so the record goes with it, one
        transaction less per command. Should the daemon die first, the record is a stale one,
        as it was between two transactions before: the next start finds no process of that
        start time to signal, and drops it. `flush_forgotten` (and `close`) delete what is
        still pending."""
        if len(self._forgotten) < MAX_FORGOTTEN_PENDING:
            self._forgotten.add(call_id)
        # Past the bound (write transactions that keep failing), the row stays: stale, and
        # dropped by the next start like any other.

    def flush_forgotten(self) -> None:
        """Delete the records forget_process_soon queued, in a transaction of their own
        (nothing at all when none is queued)."""
        if self._forgotten:
            with self._transaction():
                pass  # the deletes are the transaction's prologue

    def recorded_processes(self) -> list[RecordedProcess]:
        """Every group not yet known to be gone, oldest first."""
        with self._transaction(write=False) as conn:
            rows = conn.execute(
                "SELECT call_id, pid, pgid, start_ticks, COALESCE(cgroup, call_id) FROM processes ORDER BY recorded_at"
            ).fetchall()
        return [RecordedProcess(*row) for row in rows if row[0] not in self._forgotten]

    # -- held processes (runtime/held.py) --------------------------------------------------

    def start_held(self, record: HeldRecord, started_body: dict[str, Any]) -> list[JournalRow]:
        """Record a process its holder started and journal its exec.started, in one
        transaction: a started process always has its record."""
        now = time.time()
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO held (call_id, tool_name, command, pty, pid, pgid, start_ticks,"
                " holder_pid, holder_start_ticks, started_at, origin, context_json, cgroup)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.call_id, record.tool_name, record.command, int(record.pty), record.pid,
                    record.pgid, record.start_ticks, record.holder_pid, record.holder_start_ticks,
                    record.started_at, record.origin, record.context_json, record.cgroup,
                ),
            )
            return self._append_events_in(conn, [(EXEC_STARTED, started_body)], now, origin=record.origin)

    def append_held_output(
        self, call_id: str, events: Sequence[tuple[str, dict[str, Any]]], sent: dict[str, int], origin: str | None
    ) -> list[JournalRow]:
        """Journal a held process's exec.output events and move where its live view stands,
        in one transaction, so a restarted daemon resumes after the last journaled byte."""
        now = time.time()
        with self._transaction() as conn:
            rows = self._append_events_in(conn, events, now, origin=origin)
            self._set_sent_in(conn, call_id, sent)
            return rows

    def end_held(
        self,
        call_id: str,
        events: Sequence[tuple[str, dict[str, Any]]],
        sent: dict[str, int],
        exit_json: str,
        origin: str | None,
    ) -> list[JournalRow]:
        """Journal a held process's last exec.output events and its exec.completed, and mark it
        ended, in one transaction: its end is reported exactly once. Older ended records past
        MAX_ENDED_HELD are forgotten."""
        now = time.time()
        with self._transaction() as conn:
            updated = conn.execute(
                "UPDATE held SET exit_json = ?, ended_at = ? WHERE call_id = ? AND exit_json IS NULL",
                (exit_json, now, call_id),
            ).rowcount
            if updated != 1:
                raise StoreError(f"no running held process {call_id!r}")
            rows = self._append_events_in(conn, events, now, origin=origin)
            self._set_sent_in(conn, call_id, sent)
            conn.execute(
                "DELETE FROM held WHERE ended_at IS NOT NULL AND call_id NOT IN"
                " (SELECT call_id FROM held WHERE ended_at IS NOT NULL ORDER BY ended_at DESC LIMIT ?)",
                (MAX_ENDED_HELD,),
            )
            return rows

    def held_processes(self) -> list[HeldRecord]:
        """Every held process on record, running and recently ended, oldest start first."""
        with self._transaction(write=False) as conn:
            rows = conn.execute(f"SELECT {_HELD_COLUMNS} FROM held ORDER BY started_at, call_id").fetchall()
        return [_held_record(row) for row in rows]

    def held_record(self, call_id: str) -> HeldRecord | None:
        with self._transaction(write=False) as conn:
            row = conn.execute(f"SELECT {_HELD_COLUMNS} FROM held WHERE call_id = ?", (call_id,)).fetchone()
        return None if row is None else _held_record(row)

    @staticmethod
    def _set_sent_in(conn: sqlite3.Connection, call_id: str, sent: dict[str, int]) -> None:
        if sent:
            conn.execute(
                "UPDATE held SET stdout_sent = MAX(stdout_sent, ?), stderr_sent = MAX(stderr_sent, ?)"
                " WHERE call_id = ?",
                (sent.get("stdout", 0), sent.get("stderr", 0), call_id),
            )

    # -- helpers usable inside one _transaction() ------------------------------------------

    def _expired(self, record: CallRecord, completed_at: float | None, now: float) -> bool:
        if record.state != "completed":
            return False
        if record.result_frame is None:
            # Completed, but its result is gone (a hand-edited database): nothing to replay,
            # so the key is forgotten rather than answered with nothing.
            return True
        return completed_at is not None and completed_at <= now - self.retention.max_age_s

    def _prune_calls_in(self, conn: sqlite3.Connection, now: float, total: int | None = None) -> int:
        """Delete completed records, oldest completion first, while each is past max_age_s
        or the total of result bytes is over max_result_bytes: first the delegated spaces'
        records, then the owner's (keys.py), so a delegated socket's keyed calls never push
        the control plane's records out of the budget. Each walk uses its own partial index
        on completed_at and stops at the first record that may stay, so a call that prunes
        nothing costs two index seeks; each record is deleted once, so the work is amortised
        to at most one deletion per completion. Pending records are never touched. `total`:
        the stored bytes counter when the caller has just written it (read here otherwise)."""
        retention = self.retention
        cutoff = now - retention.max_age_s
        if total is None:
            total = _call_result_bytes(conn)
        stored = total
        victims: list[tuple[CallKey, int | None, int | None]] = []
        for walk in PRUNE_WALKS:
            cursor = conn.execute(walk)
            try:
                for space, key, completed_at, size, result_seq in cursor:
                    if completed_at > cutoff and total <= retention.max_result_bytes:
                        break
                    victims.append((CallKey(space, key), size, result_seq))
                    total -= size or 0
            finally:
                cursor.close()
        self._forget_completed_in(conn, victims, stored)
        return len(victims)

    def _forget_completed_in(
        self,
        conn: sqlite3.Connection,
        victims: Sequence[tuple[CallKey, int | None, int | None]],
        stored: int | None = None,
    ) -> None:
        """Forget completed records (key, result bytes, result seq), and each one's result
        event if an ack already covers it (the record was all that kept it). `stored`: the
        bytes counter as the caller read it, so it is not read again."""
        if not victims:
            return
        conn.executemany(
            "DELETE FROM idempotency WHERE space = ? AND key = ? AND state = 'completed'",
            [key for key, _, _ in victims],
        )
        floor = int(_read_meta(conn, META_ACK_FLOOR).get(META_ACK_FLOOR, 0))
        deleted = conn.executemany(
            "DELETE FROM events WHERE seq = ? AND seq <= ?",
            [(seq, floor) for _, _, seq in victims if seq is not None],
        ).rowcount
        freed = sum(size or 0 for _, size, _ in victims)
        # Never below zero, even over a counter a hand-edited database left too low.
        total = max(0, (_call_result_bytes(conn) if stored is None else stored) - freed)
        values = {META_CALL_RESULT_BYTES: str(total)}
        if deleted > 0:
            # An event went: `meta` keeps the last seq, so it is never assigned again.
            values[META_LAST_SEQ] = str(self._last_seq_in(conn))
        _write_meta(conn, values)

    def _append_events_in(
        self,
        conn: sqlite3.Connection,
        events: Sequence[tuple[str, dict[str, Any]]],
        now: float,
        *,
        last_view: EventView | None = None,
        origin: str | None = None,
    ) -> list[JournalRow]:
        """Append with dense seqs; each event's view is what it says (exec.* events: the
        shell's, from `origin`), except the last one's when `last_view` is given (a call's
        tool.result, whose path only the call knows)."""
        # Encode everything before the first write, so a body that is not JSON leaves no trace.
        last_seq = self._last_seq_in(conn)
        rows: list[JournalRow] = []
        for offset, (kind, body) in enumerate(events, start=1):
            seq = last_seq + offset  # encode_event refuses (ValueError) an unknown kind or bad body
            frame = encode_event(kind, seq, body)
            if last_view is not None and offset == len(events):
                view = last_view
            elif kind != TOOL_RESULT:
                view = event_view(kind, origin)
            else:
                error = body.get("error") or {}
                view = default_view(kind, body.get("tool_name"), error.get("code"))
            rows.append(JournalRow(seq, frame, view))
        conn.executemany(
            "INSERT INTO events (seq, kind, frame_json, created_at, scope, path, commands) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (row.seq, kind, row.frame, now, row.view.scope, row.view.path, row.view.commands)
                for row, (kind, _) in zip(rows, events)
            ],
        )
        # No `meta` write: the new rows hold the new last seq (_last_seq_in).
        self._journaled_through = last_seq + len(rows)  # taken, and recorded outside, once committed
        return rows

    def _last_seq_in(self, conn: sqlite3.Connection) -> int:
        """The last seq assigned, this transaction's appends included. In the database it is
        the larger of the newest event's seq and `meta`'s `last_seq`, which every transaction
        that deletes events writes first: so seqs stay dense and are never reused, even once
        the newest events are acked and gone, while an append writes no `meta` row."""
        if self._journaled_through is not None:
            return self._journaled_through
        if self._last_seq is None:
            stored = int(_read_meta(conn, META_LAST_SEQ).get(META_LAST_SEQ, 0))
            newest = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
            self._last_seq = max(stored, newest or 0)
        return self._last_seq

    def add_call_intent(self, key: CallKey, fields: dict[str, Any]) -> None:
        """Add `fields` (top-level members, replaced if present) to a pending call's intent
        in one write transaction: what `call_record` then `set_call_intent` did in two (a
        patch records its plan this way, right before it writes the file)."""
        assignments = []
        values: list[str] = []
        for name, value in fields.items():
            if not name.isidentifier():
                raise ValueError(f"intent member {name!r} is not a plain name")
            assignments.append(f"'$.{name}', json(?)")
            values.append(json.dumps(value))
        with self._transaction() as conn:
            updated = conn.execute(
                f"UPDATE idempotency SET intent_json = json_set(COALESCE(intent_json, '{{}}'), {', '.join(assignments)})"
                " WHERE space = ? AND key = ? AND state = 'pending'",
                (*values, *key),
            ).rowcount
        if updated != 1:
            raise StoreError(f"no pending call with key {key!r}")


Row = TypeVar("Row", tuple[int, str], JournalRow)


def take_within(rows: Iterable[Row], max_chars: int) -> list[Row]:
    """Rows (seq, frame, …) in order until `max_chars` characters of frames are gathered (the
    row that reaches it included, so a batch always holds at least one row)."""
    taken: list[Row] = []
    gathered = 0
    for row in rows:
        taken.append(row)
        gathered += len(row[1])
        if gathered >= max_chars:
            break
    return taken


def _call_result_bytes(conn: sqlite3.Connection) -> int:
    return int(_read_meta(conn, META_CALL_RESULT_BYTES).get(META_CALL_RESULT_BYTES, 0))


class _Unread:
    """The type of `_UNREAD`: a cached value not read from the database yet."""


_UNREAD = _Unread()


def _read_meta(conn: sqlite3.Connection, *keys: str) -> dict[str, str]:
    marks = ",".join("?" * len(keys))
    return dict(conn.execute(f"SELECT key, value FROM meta WHERE key IN ({marks})", keys))


def _write_meta(conn: sqlite3.Connection, values: dict[str, str]) -> None:
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        list(values.items()),
    )
