"""StateStore on real sqlite files: fence + jti, binding, termination, journal, durability."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.state.keys import owner_key
from sandbox_supervisor.daemon.state.store import (
    DB_FILENAME,
    SCHEMA_VERSION,
    AckAhead,
    AlreadyBound,
    CallRetention,
    FenceRegressed,
    HeldRecord,
    JtiReplayed,
    StateStore,
    StoreError,
    _PROCESSES_TABLE,
)

NOW = 1_700_000_000.0
JTI_TTL = 330.0  # exp + leeway beyond NOW, as the gate would compute it


def tool_result(**result: object) -> dict:
    """A valid tool.result body (the journal validates every event) carrying `result`."""
    return {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
            "tool_name": "read_file", "ok": True, "result": result}



@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def store(state_dir: Path):
    with StateStore.open(state_dir) as s:
        yield s


def upgrade(store: StateStore, generation: int, attempt: str, jti: str, now: float = NOW) -> None:
    store.record_upgrade(
        generation=generation, attempt_id=attempt, jti=jti, jti_expires_at=now + JTI_TTL, now=now
    )


def test_open_creates_private_state_dir_wal_and_schema(state_dir: Path) -> None:
    old_umask = os.umask(0)  # the modes must not depend on a permissive umask
    try:
        StateStore.open(state_dir).close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    db = state_dir / DB_FILENAME
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        tables = {row[0] for row in rows}
    finally:
        conn.close()
    assert {"meta", "binding", "jti", "events", "idempotency"} <= tables


def test_a_newer_schema_is_refused(state_dir: Path) -> None:
    StateStore.open(state_dir).close()
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        StateStore.open(state_dir)


def test_a_version_1_journal_is_migrated_with_its_events_intact(state_dir: Path) -> None:
    """A daemon upgraded over a version-1 state database keeps every retained event, seq
    for seq and byte for byte, and journals on without the duplicated body column."""
    from sandbox_supervisor.daemon.state.store import _MIGRATIONS

    state_dir.mkdir()
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    # Version 1 as unreleased builds wrote it: without the processes table.
    for statement in _MIGRATIONS[0]:
        if "processes" not in statement:
            conn.execute(statement)
    # Written by the version-1 encoder (json.dumps), which a migration must not rewrite.
    old_frames = [(seq, '{"kind":"exec.output","seq":%d,"body":{"n":%d,"text":"é\\n"}}' % (seq, seq)) for seq in (1, 2, 3)]
    conn.executemany(
        "INSERT INTO events (seq, kind, body_json, frame_json, created_at) VALUES (?, 'exec.output', '{}', ?, 0)",
        old_frames,
    )
    conn.execute("INSERT INTO meta (key, value) VALUES ('last_seq', '3')")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    with StateStore.open(state_dir) as migrated:
        assert migrated.events_after(0, 10) == old_frames
        rows = migrated.append_events([("tool.result", tool_result())])
        assert [row.seq for row in rows] == [4]
        assert migrated.recorded_processes() == []  # the table exists now
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        columns = [row[1] for row in conn.execute("PRAGMA table_info(events)")]
    finally:
        conn.close()
    assert columns == ["seq", "kind", "frame_json", "created_at", "scope", "path", "commands"]


def test_fresh_snapshot_is_unbound_and_empty(store: StateStore) -> None:
    snap = store.snapshot()
    assert snap.terminated is None
    assert (snap.bound_session_id, snap.binding_digest) == (None, None)
    assert (snap.fence_generation, snap.fence_attempt_id) == (0, None)
    assert (snap.local_event_max, snap.ack_floor, snap.oldest_retained_seq) == (0, 0, 1)


def test_record_upgrade_sets_fence_and_jti_together(store: StateStore) -> None:
    upgrade(store, 3, "attempt-a", "jti-1")
    snap = store.snapshot()
    assert (snap.fence_generation, snap.fence_attempt_id) == (3, "attempt-a")
    assert store.upgrade_state("jti-1", NOW).jti_seen


def test_replayed_jti_is_refused_and_changes_nothing(store: StateStore) -> None:
    upgrade(store, 1, "attempt-a", "jti-1")
    with pytest.raises(JtiReplayed):
        upgrade(store, 2, "attempt-b", "jti-1")
    # The fence did not move: the jti insert and the fence update are one transaction.
    snap = store.snapshot()
    assert (snap.fence_generation, snap.fence_attempt_id) == (1, "attempt-a")


def test_replayed_jti_is_refused_after_reopen(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        upgrade(store, 1, "attempt-a", "jti-1")
    with StateStore.open(state_dir) as store:
        assert store.upgrade_state("jti-1", NOW + 1).jti_seen
        with pytest.raises(JtiReplayed):
            upgrade(store, 2, "attempt-b", "jti-1", now=NOW + 1)


def test_expired_jti_is_forgotten(store: StateStore) -> None:
    upgrade(store, 1, "attempt-a", "jti-1")
    later = NOW + JTI_TTL
    assert not store.upgrade_state("jti-1", later).jti_seen  # expires_at is exclusive
    # Past its expiry the jti is pruned and may be recorded again.
    upgrade(store, 2, "attempt-b", "jti-1", now=later)
    assert store.snapshot().fence_generation == 2


def test_record_upgrade_prunes_expired_jti_rows(store: StateStore) -> None:
    upgrade(store, 1, "attempt-a", "old-1")
    upgrade(store, 2, "attempt-b", "old-2")
    upgrade(store, 3, "attempt-c", "new", now=NOW + JTI_TTL + 1)
    count = store._conn.execute("SELECT COUNT(*) FROM jti").fetchone()[0]
    assert count == 1


def test_same_attempt_retry_is_recorded_and_fence_never_regresses(store: StateStore) -> None:
    upgrade(store, 5, "attempt-a", "jti-1")
    upgrade(store, 5, "attempt-a", "jti-2")  # retry of the same attempt with a fresh jti
    with pytest.raises(FenceRegressed):
        upgrade(store, 5, "attempt-other", "jti-3")
    with pytest.raises(FenceRegressed):
        upgrade(store, 4, "attempt-z", "jti-4")
    assert not store.upgrade_state("jti-3", NOW).jti_seen and not store.upgrade_state("jti-4", NOW).jti_seen
    snap = store.snapshot()
    assert (snap.fence_generation, snap.fence_attempt_id) == (5, "attempt-a")


def test_binding_persists_across_reopen_and_cannot_be_replaced(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        store.bind("session-1", "d" * 64, '{"sessionId":"session-1"}', NOW)
        with pytest.raises(AlreadyBound):
            store.bind("session-2", "e" * 64, "{}", NOW)
    with StateStore.open(state_dir) as store:
        binding = store.binding()
        assert binding is not None
        assert (binding.session_id, binding.digest) == ("session-1", "d" * 64)
        assert binding.body_json == '{"sessionId":"session-1"}'
        assert binding.bound_at == NOW
        snap = store.snapshot()
        assert (snap.bound_session_id, snap.binding_digest) == ("session-1", "d" * 64)


def test_upgrade_state_reads_the_gates_facts_and_the_jti_together(store: StateStore) -> None:
    fresh = store.upgrade_state("jti-1", NOW)
    assert (fresh.bound_session_id, fresh.local_event_max) == (None, 0)
    assert (fresh.fence_generation, fresh.fence_attempt_id, fresh.jti_seen) == (0, None, False)
    upgrade(store, 3, "attempt-a", "jti-1")
    store.bind("session-1", "d" * 64, "{}", NOW)
    store.append_events([("tool.result", tool_result(n=1))], now=NOW)
    state = store.upgrade_state("jti-1", NOW)
    assert (state.bound_session_id, state.local_event_max) == ("session-1", 1)
    assert (state.fence_generation, state.fence_attempt_id, state.jti_seen) == (3, "attempt-a", True)
    assert not store.upgrade_state("jti-2", NOW).jti_seen
    assert not store.upgrade_state("jti-1", NOW + JTI_TTL).jti_seen  # expired: not a replay


def _statements(store: StateStore) -> list[str]:
    """Every SQL statement the store's connection runs from now on."""
    seen: list[str] = []
    store._conn.set_trace_callback(seen.append)
    return seen


def test_the_binding_is_read_once_and_kept_after_it_is_written(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        seen = _statements(store)
        assert store.binding() is None
        assert store.binding() is None and store.snapshot().bound_session_id is None
        assert sum("FROM binding" in sql for sql in seen) == 1  # unbound is remembered too
        store.bind("session-1", "d" * 64, "{}", NOW)
        seen.clear()
        binding = store.binding()
        assert binding is not None and (binding.session_id, binding.bound_at) == ("session-1", NOW)
        assert store.upgrade_state("jti-1", NOW).bound_session_id == "session-1"
        assert store.snapshot().binding_digest == "d" * 64
        assert not any("binding" in sql for sql in seen)  # the written binding, no read
    with StateStore.open(state_dir) as store:
        seen = _statements(store)
        assert store.snapshot().bound_session_id == "session-1"
        binding = store.binding()
        assert binding is not None and binding.digest == "d" * 64
        assert sum("FROM binding" in sql for sql in seen) == 1


class _CommitLandsThenFails:
    """The store's connection, whose next COMMIT is carried out and then reported failed, as
    sqlite may report a COMMIT that landed (an I/O error after the WAL frames were written)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        cursor = self._conn.execute(sql, *args)
        if sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error")
        return cursor

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


def test_a_refused_or_failed_bind_leaves_the_binding_as_the_database_has_it(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        assert store.binding() is None  # "unbound" is cached now
        real = store._conn
        store._conn = _CommitLandsThenFails(real)  # type: ignore[assignment]
        with pytest.raises(StoreError):
            store.bind("session-1", "d" * 64, "{}", NOW)
        store._conn = real
        seen = _statements(store)
        binding = store.binding()  # read again: the failed COMMIT had landed
        assert binding is not None and binding.session_id == "session-1"
        assert sum("FROM binding" in sql for sql in seen) == 1
        with pytest.raises(AlreadyBound):
            store.bind("session-2", "e" * 64, "{}", NOW)
        assert store.upgrade_state("jti-1", NOW).bound_session_id == "session-1"
    with StateStore.open(state_dir / "other") as store:
        assert store.binding() is None
        store._conn.execute("PRAGMA query_only = ON")  # every write fails: the bind's too
        with pytest.raises(StoreError):
            store.bind("session-1", "d" * 64, "{}", NOW)
        store._conn.execute("PRAGMA query_only = OFF")
        assert store.binding() is None  # nothing landed: still unbound, as read again
    with pytest.raises(StoreError):
        store.binding()  # a closed store answers nothing, not even from what it kept


def test_terminated_flag_persists_and_keeps_the_first_reason(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        assert store.snapshot().terminated is None
        store.mark_terminated("profile_not_allowed", "Profile is not allowed.", NOW)
        store.mark_terminated("other", "later", NOW + 5)
    with StateStore.open(state_dir) as store:
        terminated = store.snapshot().terminated
    assert terminated is not None
    assert (terminated.code, terminated.message, terminated.at) == (
        "profile_not_allowed", "Profile is not allowed.", NOW
    )


def test_append_events_assigns_dense_seqs_and_returns_stored_frames(store: StateStore) -> None:
    output = {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "stream": "stdout", "text": "héllo",
              "offset": 0, "bytes": 6, "truncated": False, "dropped_bytes": 0, "after_exit": False}
    frames = store.append_events([("exec.output", output), ("tool.result", tool_result(n=1))], now=NOW)
    body = json.dumps(output, separators=(",", ":"), ensure_ascii=False)
    assert frames[0][:2] == (1, '{"kind":"exec.output","seq":1,"body":' + body + "}")
    assert frames[1][0] == 2 and json.loads(frames[1][1]) == {"kind": "tool.result", "seq": 2, "body": tool_result(n=1)}
    third = store.append_events([("tool.result", tool_result(n=3))])
    assert third[0][0] == 3
    assert store.events_after(0, 10) == [row[:2] for row in (*frames, *third)]
    assert store.events_after(1, 1) == [frames[1][:2]]
    assert store.append_events([]) == []
    assert store.snapshot().local_event_max == 3


def test_a_batch_with_a_bad_event_journals_nothing(store: StateStore) -> None:
    with pytest.raises(ValueError):
        store.append_events([("tool.result", tool_result()), ("exec.output", {"x": float("nan")})])
    with pytest.raises(ValueError):
        store.append_events([("tool.result", tool_result()), ("not.an.event", tool_result())])
    assert store.snapshot().local_event_max == 0
    assert store.events_after(0, 10) == []


def test_seqs_stay_dense_across_reopen_and_prune(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        store.append_events([("tool.result", tool_result(n=n)) for n in range(1, 6)], now=NOW)
        assert store.raise_ack_floor(5) == 5
        snap = store.snapshot()
        # Everything pruned: oldest retained is one past the max, and the max is kept.
        assert (snap.local_event_max, snap.oldest_retained_seq) == (5, 6)
    with StateStore.open(state_dir) as store:
        assert [row.seq for row in store.append_events([("tool.result", tool_result()), ("tool.result", tool_result())])] == [6, 7]
        snap = store.snapshot()
        assert (snap.local_event_max, snap.oldest_retained_seq, snap.ack_floor) == (7, 6, 5)


def test_an_appended_event_writes_its_row_and_nothing_else(store: StateStore) -> None:
    """The last seq lives in memory, not in a meta row rewritten by every append: an event's
    commit changes one row (the hot path's commit writes one page fewer)."""
    store.append_events([("tool.result", tool_result())], now=NOW)
    before = store._conn.total_changes
    assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [2]
    assert store._conn.total_changes - before == 1
    assert store.snapshot().local_event_max == 2


def test_a_rolled_back_append_leaves_no_gap_and_a_restart_no_reuse(state_dir: Path) -> None:
    """The in-memory last seq moves only with a commit; after a restart it is read back even
    when the newest events were acked away (meta keeps it) or were never in meta (the rows)."""
    with StateStore.open(state_dir) as store:
        store.append_events([("tool.result", tool_result())], now=NOW)
        with pytest.raises(StoreError):
            # Its tool.result is appended, then the missing record fails the transaction.
            store.complete_call(owner_key("absent"), tool_result(), now=NOW)
        assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [2]
    with StateStore.open(state_dir) as store:
        assert store.snapshot().local_event_max == 2
        assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [3]
        assert store.raise_ack_floor(3) == 3
    with StateStore.open(state_dir) as store:
        assert store.events_after(0, 10) == []
        assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [4]


def test_a_commit_that_landed_but_reported_an_error_does_not_leave_a_stale_last_seq(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A COMMIT can fail after the commit landed (an I/O error variant): the in-memory last seq
    must not stay behind the database, or every later append collides with a used seq."""
    store.append_events([("tool.result", tool_result())], now=NOW)
    real = store._idle_connection()

    class CommitLandsThenFails:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def execute(self, sql: str, *args: object) -> object:
            result = real.execute(sql, *args)
            if sql == "COMMIT":
                raise sqlite3.OperationalError("disk I/O error (after the commit landed)")
            return result

    monkeypatch.setattr(store, "_idle_connection", lambda: CommitLandsThenFails())
    with pytest.raises(StoreError):
        store.append_events([("tool.result", tool_result())], now=NOW)
    monkeypatch.undo()
    assert store._conn.execute("SELECT MAX(seq) FROM events").fetchone()[0] == 2  # it landed
    assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [3]


def test_a_forgotten_newest_result_is_not_reused_after_a_restart(state_dir: Path) -> None:
    """An acked result that a record kept is deleted when the record is pruned: if it was
    the newest event, its seq must still never be assigned again."""
    key = owner_key("k")
    with StateStore.open(state_dir, CallRetention(max_age_s=60.0)) as store:
        assert store.begin_call(key=key, tool_name="read_file", digest="d" * 64,
                                call_id="0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", intent_json=None, now=NOW) is None
        assert [row.seq for row in store.complete_call(key, tool_result(), now=NOW)] == [1]
        assert store.raise_ack_floor(1) == 1
        assert [seq for seq, _ in store.events_after(0, 10)] == []  # kept for the record only
        assert store.prune_calls(now=NOW + 3600) == 1
        assert store._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0
    with StateStore.open(state_dir) as store:
        assert store.snapshot().local_event_max == 1
        assert [row.seq for row in store.append_events([("tool.result", tool_result())], now=NOW)] == [2]


def test_an_ack_prunes_what_the_floor_covers_and_no_more(store: StateStore) -> None:
    store.append_events([("tool.result", tool_result()) for _ in range(4)], now=NOW)
    store.raise_ack_floor(2)
    assert [seq for seq, _ in store.events_after(0, 10)] == [3, 4]
    assert store.snapshot().oldest_retained_seq == 3
    # A lower ack later never lowers the floor, and prunes nothing more.
    assert store.raise_ack_floor(1) == 2
    assert [seq for seq, _ in store.events_after(0, 10)] == [3, 4]


def test_an_ack_that_fails_moves_neither_the_floor_nor_the_journal(store: StateStore) -> None:
    """Floor and prune are one transaction: a failure half way leaves both as they were."""
    store.append_events([("tool.result", tool_result()) for _ in range(3)], now=NOW)
    store._conn.execute(
        "CREATE TEMP TRIGGER refuse_prune BEFORE DELETE ON events BEGIN SELECT RAISE(ABORT, 'disk I/O'); END"
    )
    with pytest.raises(StoreError):
        store.raise_ack_floor(2)
    assert store.snapshot().ack_floor == 0
    assert [seq for seq, _ in store.events_after(0, 10)] == [1, 2, 3]


def test_ack_floor_never_lowers_and_never_passes_the_journal(state_dir: Path) -> None:
    with StateStore.open(state_dir) as store:
        store.append_events([("tool.result", tool_result()) for _ in range(5)], now=NOW)
        assert store.raise_ack_floor(4) == 4
        assert store.raise_ack_floor(2) == 4
        with pytest.raises(AckAhead):
            store.raise_ack_floor(6)
    with StateStore.open(state_dir) as store:
        assert store.snapshot().ack_floor == 4
        assert store.raise_ack_floor(0) == 4


def test_nested_transaction_is_refused_and_outer_one_still_atomic(store: StateStore) -> None:
    with store._transaction() as conn:
        with pytest.raises(StoreError, match="do not nest"):
            store.snapshot()
        conn.execute("INSERT INTO meta (key, value) VALUES ('probe', '1')")
    assert store._conn.execute("SELECT value FROM meta WHERE key='probe'").fetchone() == ("1",)
    # An error escaping the block rolls back everything written in it.
    with pytest.raises(RuntimeError):
        with store._transaction() as conn:
            conn.execute("UPDATE meta SET value = '2' WHERE key = 'probe'")
            raise RuntimeError("boom")
    assert store._conn.execute("SELECT value FROM meta WHERE key='probe'").fetchone() == ("1",)


def test_closed_store_raises_store_error(state_dir: Path) -> None:
    store = StateStore.open(state_dir)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError):
        store.snapshot()


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from sandbox_supervisor.daemon.state.store import StateStore

    store = StateStore.open(Path(sys.argv[1]))
    store.record_upgrade(generation=7, attempt_id="attempt-7", jti="jti-7",
                         jti_expires_at=2e9, now=1.7e9)
    store.bind("session-k", "f" * 64, "{}", 1.7e9)
    body = {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
            "tool_name": "read_file", "ok": True}
    store.append_events([("tool.result", {**body, "result": {"n": n}}) for n in range(3)], now=1.7e9)
    store.raise_ack_floor(2)
    print("ok", flush=True)
    time.sleep(60)
    """
)


def test_writes_survive_kill_9_of_the_writer(state_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line == "ok\n", proc.stderr.read() if proc.poll() is not None else line
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    with StateStore.open(state_dir) as store:
        snap = store.snapshot()
        assert (snap.fence_generation, snap.fence_attempt_id) == (7, "attempt-7")
        assert snap.bound_session_id == "session-k"
        assert (snap.local_event_max, snap.ack_floor) == (3, 2)
        assert store.upgrade_state("jti-7", 1.7e9).jti_seen
        # All three were committed; the ack pruned what it covered, with the floor.
        assert [json.loads(f)["body"]["result"] for _, f in store.events_after(0, 10)] == [{"n": 2}]


def _started(call_id: str) -> dict:
    return {
        "call_id": call_id, "pid": 4242, "pgid": 4242, "command": "true", "cwd": "/",
        "started_at": 1_700_000_000.0,
        "context": {"session_id": "s-1", "generation": 1, "idempotency_key": None},
    }


def _process_rows(state_dir: Path) -> list[str]:
    with sqlite3.connect(state_dir / DB_FILENAME) as conn:
        return [row[0] for row in conn.execute("SELECT call_id FROM processes")]


def test_a_process_forgotten_soon_goes_with_the_next_write_transaction(tmp_path: Path) -> None:
    """forget_process_soon: the record leaves the database in the next write transaction
    (the call's result, which follows at once), not in one of its own; recorded_processes no
    longer lists it meanwhile; a rolled-back transaction keeps it pending; close deletes what
    is left."""
    call_id, other = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "1c8d3fa0-63b5-4b1f-8e66-4f1b5a4f9f32"
    store = StateStore.open(tmp_path)
    store.start_process(call_id, 4242, 4242, 99, _started(call_id))
    store.start_process(other, 4343, 4343, 99, _started(other))
    store.forget_process_soon(call_id)
    assert sorted(_process_rows(tmp_path)) == sorted([call_id, other])  # no transaction of its own
    assert [row[0] for row in store.recorded_processes()] == [other]
    with pytest.raises(StoreError):
        with store._transaction():
            raise sqlite3.OperationalError("disk I/O error")  # rolled back: still pending
    assert sorted(_process_rows(tmp_path)) == sorted([call_id, other])
    store.append_events([("tool.result", tool_result(n=1))])  # any write: the result's commit
    assert _process_rows(tmp_path) == [other]
    store.forget_process_soon(other)
    store.close()
    assert _process_rows(tmp_path) == []


def test_a_process_record_keeps_its_cgroups_name_and_an_older_one_reads_as_its_call_id(tmp_path: Path) -> None:
    """Schema 8 (runtime/ready_cgroups.py): a command's cgroup made ahead is named apart from
    its call, so the record keeps the name; a record written before the column existed (or
    with no name) reads back as the call_id, which is what its cgroup is named after."""
    ahead, named, older = (
        "2d9e4ab1-74c6-4c20-9f77-5a2c6b5aa043",
        "3eaf5bc2-85d7-4d31-8a88-6b3d7c6bb154",
        "4fb06cd3-96e8-4e42-9b99-7c4e8d7cc265",
    )
    with StateStore.open(tmp_path) as store:
        store.start_process(ahead, 4242, 4242, 99, _started(ahead), cgroup="ready-0123abcd")
        store.start_process(named, 4343, 4343, 99, _started(named))
    # What schema 7 left: no cgroup column, one record.
    with sqlite3.connect(tmp_path / DB_FILENAME) as conn:
        conn.execute("ALTER TABLE processes RENAME TO processes_v8")
        conn.execute(_PROCESSES_TABLE)
        conn.execute("INSERT INTO processes SELECT call_id, pid, pgid, start_ticks, recorded_at FROM processes_v8")
        conn.execute("DROP TABLE processes_v8")
        conn.execute("INSERT INTO processes VALUES (?, 4444, 4444, 99, 1e9)", (older,))
        conn.execute("ALTER TABLE held DROP COLUMN cgroup")  # schema 9's
        conn.execute("PRAGMA user_version=7")
    conn.close()
    with StateStore.open(tmp_path) as store:
        recorded = {row.call_id: row.cgroup for row in store.recorded_processes()}
        store.start_process(ahead, 4242, 4242, 99, _started(ahead), cgroup="ready-0123abcd")
        again = {row.call_id: row.cgroup for row in store.recorded_processes()}
    assert recorded == {ahead: ahead, named: named, older: older}  # the v7 rows knew no name
    assert again[ahead] == "ready-0123abcd" and again[older] == older


def _held(call_id: str, cgroup: str | None = None) -> HeldRecord:
    return HeldRecord(
        call_id=call_id, tool_name="start_process", command="sleep 300", pty=False, pid=4242, pgid=4242,
        start_ticks=99, holder_pid=4141, holder_start_ticks=98, started_at=1_700_000_000.0, origin=None,
        context_json=json.dumps(_started(call_id)["context"]), cgroup=cgroup,
    )


def test_a_held_record_keeps_its_cgroups_name_and_an_older_one_reads_as_its_call_id(tmp_path: Path) -> None:
    """Schema 9: a held process's cgroup made ahead is named apart from its call, so the
    `held` record keeps the name; a record of schema 8, which had no such column, reads
    back with none, and its cgroup's name is its call_id."""
    ahead, older, later, plain = (
        "5ac17de4-a7f8-4f53-8caa-8d5f9e8dd376",
        "6bd28ef5-b809-4064-9dbb-9e6fa09ee487",
        "7ce39f06-c91a-4175-aecc-af7eb1aff598",
        "8df4a017-da2b-4286-bfdd-b08fc2b00609",
    )
    with StateStore.open(tmp_path) as store:
        store.start_held(_held(ahead, "ready-4567cdef"), _started(ahead))
        recorded = store.held_record(ahead)
        assert recorded is not None and recorded.cgroup == "ready-4567cdef"
    # What schema 8 left: no cgroup column in `held` (so the name above is lost), a record more.
    with sqlite3.connect(tmp_path / DB_FILENAME) as conn:
        conn.execute("ALTER TABLE held DROP COLUMN cgroup")
        conn.execute(
            "INSERT INTO held (call_id, tool_name, command, pty, pid, pgid, start_ticks, holder_pid,"
            " holder_start_ticks, started_at, origin, context_json) VALUES (?, 'start_process', 'true', 0,"
            " 4343, 4343, 99, 4141, 98, 1e9, NULL, '{}')",
            (older,),
        )
        conn.execute("PRAGMA user_version=8")
    conn.close()
    with StateStore.open(tmp_path) as store:
        read = {record.call_id: (record.cgroup, record.cgroup_name) for record in store.held_processes()}
        store.start_held(_held(later, "ready-89abcdef"), _started(later))
        store.start_held(_held(plain), _started(plain))
    with StateStore.open(tmp_path) as store:
        names = {record.call_id: record.cgroup_name for record in store.held_processes()}
    assert read == {ahead: (None, ahead), older: (None, older)}
    assert names[later] == "ready-89abcdef" and names[plain] == plain
