"""Retention of completed idempotency records (docs/protocol.md §8): by age and by the total
size of stored results, oldest first, never a pending record; a forgotten key runs again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.state.store import (
    PRUNE_WALKS,
    DB_FILENAME,
    META_CALL_RESULT_BYTES,
    CallRetention,
    StateStore,
)
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout
from sandbox_supervisor.daemon.state.keys import LEGACY_SPACE, CallKey, owner_key

NOW = 1_700_000_000.0
DAY = 24 * 3600.0
DIGEST = "d" * 64


def result_body(key: str, text: str = "") -> dict:
    return {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": key,
            "tool_name": "read_file", "ok": True, "result": {"content": text}}


def run_call(store: StateStore, key: str, now: float, text: str = "") -> int:
    """Begin and complete a keyed call at `now`; returns the bytes of its stored frame."""
    assert store.begin_call(key=owner_key(key), tool_name="read_file", digest=DIGEST,
                            call_id="0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", intent_json=None, now=now) is None
    rows = store.complete_call(owner_key(key), result_body(key, text), now=now)
    return len(rows[-1][1].encode())


def keys_of(store: StateStore) -> set[str]:
    conn = sqlite3.connect(store.path)
    try:
        return {row[0] for row in conn.execute("SELECT key FROM idempotency")}
    finally:
        conn.close()


def test_completed_records_past_max_age_are_pruned_oldest_first(tmp_path: Path) -> None:
    with StateStore.open(tmp_path / "state", CallRetention(max_age_s=DAY)) as store:
        run_call(store, "old", NOW)
        run_call(store, "mid", NOW + 10)
        # Just inside the age: both kept.
        run_call(store, "a", NOW + DAY - 1)
        assert keys_of(store) == {"old", "mid", "a"}
        # "old" is now exactly max_age_s old: forgotten by the next completion; "mid" stays.
        run_call(store, "b", NOW + DAY)
        assert keys_of(store) == {"mid", "a", "b"}
        assert store.call_result_bytes() == sum(
            len((store.call_record(owner_key(k)).result_frame or "").encode()) for k in ("mid", "a", "b")
        )


def test_an_expired_key_counts_as_new_even_before_any_pruning(tmp_path: Path) -> None:
    """Nothing completed since the record expired, so nothing pruned it: begin_call itself
    must not answer from an expired record."""
    with StateStore.open(tmp_path / "state", CallRetention(max_age_s=DAY)) as store:
        run_call(store, "k", NOW)
        assert store.begin_call(key=owner_key("k"), tool_name="read_file", digest=DIGEST, call_id="c",
                                intent_json=None, now=NOW + DAY - 1) is not None  # remembered
        assert store.begin_call(key=owner_key("k"), tool_name="read_file", digest=DIGEST, call_id="c2",
                                intent_json=None, now=NOW + DAY) is None  # claimed anew
        record = store.call_record(owner_key("k"))
        assert record is not None and (record.state, record.call_id) == ("pending", "c2")
        assert store.call_result_bytes() == 0


def test_the_total_of_stored_results_stays_within_max_result_bytes(tmp_path: Path) -> None:
    text = "x" * 1000
    with StateStore.open(tmp_path / "state") as probe:
        size = run_call(probe, "probe", NOW, text)  # the frame size of one such call
    budget = 3 * size + 20  # room for three (seqs and keys grow by a digit), not four
    with StateStore.open(tmp_path / "state2", CallRetention(max_result_bytes=budget)) as store:
        sizes = {}
        for n in range(10):
            sizes[f"k{n}"] = run_call(store, f"k{n}", NOW + n, text)
            assert store.call_result_bytes() <= budget
        assert keys_of(store) == {"k7", "k8", "k9"}  # the oldest went first
        assert store.call_result_bytes() == sizes["k7"] + sizes["k8"] + sizes["k9"]


def test_pending_records_are_never_pruned(tmp_path: Path) -> None:
    with StateStore.open(tmp_path / "state", CallRetention(max_age_s=1.0, max_result_bytes=1)) as store:
        assert store.begin_call(key=owner_key("pending"), tool_name="read_file", digest=DIGEST, call_id="c",
                                intent_json=None, now=NOW) is None
        run_call(store, "done", NOW + 5 * DAY, "y" * 100)  # over both limits at once
        assert store.prune_calls(now=NOW + 10 * DAY) == 0
        assert keys_of(store) == {"pending"}
        assert [r.key for r in store.pending_calls()] == ["pending"]
    # Nor on opening, which prunes with the same rules.
    with StateStore.open(tmp_path / "state", CallRetention(max_age_s=1.0, max_result_bytes=1)) as store:
        assert [r.key for r in store.pending_calls()] == ["pending"]


def test_lowered_limits_apply_when_the_store_is_opened(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    forever = 1e12  # the records are dated NOW, in the past: only the size limit may act
    with StateStore.open(state_dir, CallRetention(max_age_s=forever)) as store:
        sizes = [run_call(store, f"k{n}", NOW + n, "z" * 500) for n in range(4)]
    with StateStore.open(state_dir, CallRetention(max_age_s=forever, max_result_bytes=sizes[0] * 2 + 4)) as store:
        assert keys_of(store) == {"k2", "k3"}
        assert store.call_result_bytes() == sizes[2] + sizes[3]


def test_a_version_2_database_is_migrated_with_its_result_sizes_counted(tmp_path: Path) -> None:
    """A daemon upgraded over a version-2 database counts the results already stored, so the
    budget covers them, and keeps replaying them byte for byte."""
    from sandbox_supervisor.daemon.state.store import _MIGRATIONS

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    for step in _MIGRATIONS[:2]:
        for statement in step:
            conn.execute(statement)
    frames = {"a": '{"kind":"tool.result","seq":1,"body":{"é":"%s"}}' % ("a" * 100),
              "b": '{"kind":"tool.result","seq":2,"body":{"b":"%s"}}' % ("b" * 300)}
    conn.executemany(
        "INSERT INTO idempotency (key, tool_name, digest, call_id, state, result_seq, result_frame,"
        " created_at, completed_at) VALUES (?, 'read_file', ?, 'c', 'completed', ?, ?, ?, ?)",
        [("a", DIGEST, 1, frames["a"], NOW, NOW), ("b", DIGEST, 2, frames["b"], NOW + 1, NOW + 1)],
    )
    conn.execute("INSERT INTO idempotency (key, tool_name, digest, call_id, state, created_at)"
                 " VALUES ('p', 'read_file', ?, 'c', 'pending', ?)", (DIGEST, NOW))
    conn.execute("INSERT INTO meta (key, value) VALUES ('last_seq', '2')")
    conn.execute("PRAGMA user_version=2")
    conn.commit()
    conn.close()
    sizes = {k: len(v.encode()) for k, v in frames.items()}
    # Generous limits: nothing is pruned on opening, whatever the clock says.
    with StateStore.open(state_dir, CallRetention(max_age_s=1e12)) as store:
        assert store.call_result_bytes() == sizes["a"] + sizes["b"]
        # Written before key spaces: whose it was is unknown, so it is in the legacy space.
        assert store.call_record(CallKey(LEGACY_SPACE, "a")).result_frame == frames["a"]
        assert keys_of(store) == {"a", "b", "p"}
    # The budget now covers the migrated rows: oldest first, the pending one untouched.
    with StateStore.open(state_dir, CallRetention(max_age_s=1e12, max_result_bytes=sizes["b"])) as store:
        assert keys_of(store) == {"b", "p"}
        assert store.call_result_bytes() == sizes["b"]


def test_the_prune_queries_use_the_completion_indexes(tmp_path: Path) -> None:
    """The per-completion prune is two index seeks (delegated spaces, then the owner's), not
    a scan of every record: neither walk reads the other side's rows."""
    with StateStore.open(tmp_path / "state") as store:
        path = store.path
    conn = sqlite3.connect(path)
    try:
        plans = [
            " ".join(str(row) for row in conn.execute(f"EXPLAIN QUERY PLAN {walk}")) for walk in PRUNE_WALKS
        ]
    finally:
        conn.close()
    assert "idempotency_delegated_completed" in plans[0] and "idempotency_owner_completed" in plans[1], plans
    assert not any("TEMP B-TREE" in plan for plan in plans), plans


async def test_a_forgotten_key_runs_again_over_the_wire(tmp_path: Path) -> None:
    """A keyed read_file is replayed while remembered; once its record is past max_age_s the
    same key is a new call: a new tool.result for the retry's call_id, not tool.replayed."""
    layout = make_layout(tmp_path / "d")
    (layout.workspace / "f.txt").write_text("first\n")
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            first = await session.call_and_wait("read_file", {"path": "f.txt"}, idempotency_key="k")
            assert first["ok"] is True and first["result"]["content"] == "first\n"
            await session.call("read_file", {"path": "f.txt"}, idempotency_key="k")
            await session.receive_until(lambda f: f["kind"] == "tool.replayed")
            # Age the record past max_age_s (24 h by default) through another connection.
            conn = sqlite3.connect(layout.state_dir / DB_FILENAME)
            with conn:
                conn.execute("UPDATE idempotency SET completed_at = completed_at - 2 * 86400")
            conn.close()
            (layout.workspace / "f.txt").write_text("second\n")
            retry = await session.call("read_file", {"path": "f.txt"}, idempotency_key="k")
            frame = await session.receive_until(
                lambda f: f["kind"] in ("tool.result", "tool.replayed") and f["body"].get("call_id") == retry)
    assert frame["kind"] == "tool.result"
    assert frame["body"]["result"]["content"] == "second\n"  # it ran again


async def test_repeated_large_keyed_reads_stay_within_the_budget(tmp_path: Path) -> None:
    """The attack of the issue: many keyed reads of a large file. The stored results, and so
    the database, stop growing at the configured budget."""
    budget = 512 * 1024
    layout = make_layout(tmp_path / "d", idempotency={"max_result_bytes": budget})
    (layout.workspace / "big.txt").write_text("q" * 64 * 1024)
    async with in_process_daemon(layout) as daemon:
        store = daemon.supervisor.store
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for n in range(40):
                result = await session.call_and_wait("read_file", {"path": "big.txt"}, idempotency_key=f"k{n}")
                assert result["ok"] is True
                assert store.call_result_bytes() <= budget
            # k0 was pushed out by newer results: the same key runs again.
            retry = await session.call("read_file", {"path": "big.txt"}, idempotency_key="k0")
            frame = await session.receive_until(
                lambda f: f["kind"] in ("tool.result", "tool.replayed") and f["body"].get("call_id") == retry)
            assert frame["kind"] == "tool.result"
            conn = sqlite3.connect(layout.state_dir / DB_FILENAME)
            try:
                # Each result is stored once: in the journal row its record points at.
                stored = conn.execute(
                    "SELECT COUNT(*), SUM(length(CAST(e.frame_json AS BLOB))) FROM idempotency AS i"
                    " JOIN events AS e ON e.seq = i.result_seq").fetchone()
                counter = int(conn.execute("SELECT value FROM meta WHERE key = ?",
                                           (META_CALL_RESULT_BYTES,)).fetchone()[0])
            finally:
                conn.close()
    count, total = stored
    assert total == counter <= budget  # the counter is the true sum
    assert 1 <= count < 40  # the oldest were forgotten; 41 × 64 KiB would be 2.6 MiB
