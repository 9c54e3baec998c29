"""Who sees which journaled event (state.visibility, docs/protocol.md §9.1), and the store's
side of it: views kept with events, results stored once (§8), and the migration to both."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import DB_FILENAME, SCHEMA_VERSION, _MIGRATIONS, StateStore
from sandbox_supervisor.daemon.state.keys import LEGACY_SPACE, CallKey, owner_key
from sandbox_supervisor.daemon.state.visibility import (
    PUBLIC,
    SHELL_VIEW,
    UNKNOWN_PATH,
    Audience,
    EventView,
    default_view,
    result_view,
    visible,
)

CALL_ID = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21"
ALL = frozenset({"files:read", "files:write", "shell:exec"})
READER = Audience(frozenset({"files:read"}), ("/ws/src",))


def read_result(content: str = "x", key: str | None = None) -> dict:
    result = {"path": "a", "sha": "0" * 40, "size": 1, "offset": 0, "length": 1, "encoding": "utf-8",
              "content": content, "eof": True}
    return {"call_id": CALL_ID, "idempotency_key": key, "tool_name": "read_file", "ok": True, "result": result}


VIEWS = [
    # (view, audience, visible)
    (EventView("files:read", "/ws/src/a.py"), READER, True),
    (EventView("files:read", "/ws/src"), READER, True),
    (EventView("files:read", "/ws/srcx/a.py"), READER, False),  # whole components
    (EventView("files:read", "/ws/secret/a"), READER, False),
    (EventView("files:read", UNKNOWN_PATH), READER, False),
    (EventView("files:read", None), READER, True),  # path_outside_workspace: not path-bound
    (EventView("files:write", "/ws/src/a.py"), READER, False),
    (SHELL_VIEW, READER, False),
    (PUBLIC, READER, True),
    (PUBLIC, Audience(frozenset(), ()), True),
    (EventView("files:read", UNKNOWN_PATH), Audience(ALL, None), True),
    (SHELL_VIEW, Audience(ALL, None), True),
]


@pytest.mark.parametrize("view, audience, expected", VIEWS)
def test_visible(view, audience, expected):
    assert visible(view, audience) is expected


def test_views_of_results_and_events():
    assert result_view("read_file", None, "/ws/a") == EventView("files:read", "/ws/a")
    # A live failure before any path was resolved tells only its caller's input: scope alone;
    # a success with no path known is bound to an unknown one (outside every allowed path).
    assert result_view("read_file", errors.INVALID_PARAMETERS, None) == EventView("files:read", None)
    assert result_view("read_file", errors.PATH_OUTSIDE_WORKSPACE, None) == EventView("files:read", None)
    assert result_view("apply_file_patch", None, None) == EventView("files:write", UNKNOWN_PATH)
    # Rows from before views existed: a file tool's failure may carry a sha, so unknown too.
    assert default_view("tool.result", "apply_file_patch", "base_sha_mismatch") == EventView("files:write", UNKNOWN_PATH)
    assert default_view("tool.result", "read_file", errors.PATH_OUTSIDE_WORKSPACE) == EventView("files:read", None)
    assert result_view("execute_shell_command", None, None) == SHELL_VIEW
    assert result_view("no_such_tool", errors.INVALID_PARAMETERS, None) == PUBLIC
    assert result_view(None, errors.INVALID_PARAMETERS, None) == PUBLIC
    for kind in ("exec.started", "exec.output", "exec.completed"):
        assert default_view(kind) == SHELL_VIEW
    with pytest.raises(ValueError):
        default_view("event.withheld")


def test_only_the_control_planes_own_audience_skips_the_check():
    assert Audience(ALL | {"session:control"}, None).sees_everything
    assert not Audience(ALL, ("/ws",)).sees_everything
    assert not Audience(frozenset({"files:read"}), None).sees_everything


def test_the_journal_withholds_per_audience_from_memory_and_from_the_store(tmp_path: Path):
    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        journal.complete_call(None, read_result("inside"), view=EventView("files:read", "/ws/src/a"))
        journal.complete_call(None, read_result("outside"), view=EventView("files:read", "/ws/b"))
        for rows in (journal.frames_after(0, 10, audience=READER), Journal(store).frames_after(0, 10, audience=READER)):
            assert [json.loads(frame) for _, frame in rows][1] == {"kind": "event.withheld", "seq": 2, "body": {}}
            assert json.loads(rows[0][1])["body"]["result"]["content"] == "inside"
        # Without an audience (or one that sees everything) the frames are the stored ones.
        assert journal.frames_after(0, 10) == store.events_after(0, 10)


def test_a_keyed_result_is_stored_once_and_outlives_the_ack_only_while_its_record_does(tmp_path: Path):
    with StateStore.open(tmp_path / "state") as store:
        store.begin_call(key=owner_key("k"), tool_name="read_file", digest="d", call_id=CALL_ID, intent_json=None)
        rows = store.complete_call(owner_key("k"), read_result("kept", key="k"), view=EventView("files:read", "/ws/a"))
        store.append_events([("tool.result", read_result("plain"))])
        columns = [row[1] for row in store._conn.execute("PRAGMA table_info(idempotency)")]
        assert "result_frame" not in columns  # no second copy of the result
        store.raise_ack_floor(2)
        # Acked: not replayed any more, but the record still has its exact frame.
        assert store.events_after(0, 10) == []
        assert store.snapshot().oldest_retained_seq == 3
        record = store.call_record(owner_key("k"))
        assert record.result_frame == rows[-1].frame
        assert record.result_view == EventView("files:read", "/ws/a")
        assert [seq for (seq,) in store._conn.execute("SELECT seq FROM events")] == [1]
    # Forgetting the record (retention) takes the acked result with it.
    from sandbox_supervisor.daemon.state.store import CallRetention

    with StateStore.open(tmp_path / "state", CallRetention(max_result_bytes=1)) as store:
        assert store.call_record(owner_key("k")) is None
        assert store._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0


def test_a_version_3_database_is_migrated_to_views_and_results_stored_once(tmp_path: Path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    for step in _MIGRATIONS[:3]:
        for statement in step:
            conn.execute(statement)
    shell_output = {"call_id": CALL_ID, "stream": "stdout", "text": "hi", "offset": 0, "bytes": 2,
                    "truncated": False, "dropped_bytes": 0, "after_exit": False}
    pruned = json.dumps({"kind": "tool.result", "seq": 1, "body": read_result("old", key="k1")}, separators=(",", ":"))
    kept = json.dumps({"kind": "tool.result", "seq": 3, "body": read_result("new", key="k3")}, separators=(",", ":"))
    output = json.dumps({"kind": "exec.output", "seq": 2, "body": shell_output}, separators=(",", ":"))
    conn.executemany("INSERT INTO events (seq, kind, frame_json, created_at) VALUES (?, ?, ?, 0)",
                     [(2, "exec.output", output), (3, "tool.result", kept)])
    conn.executemany(
        "INSERT INTO idempotency (key, tool_name, digest, call_id, state, result_seq, result_frame, created_at,"
        " completed_at, result_bytes) VALUES (?, 'read_file', 'd', ?, 'completed', ?, ?, 0, 0, ?)",
        [("k1", CALL_ID, 1, pruned, len(pruned)), ("k3", CALL_ID, 3, kept, len(kept))],
    )
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     [("last_seq", "3"), ("ack_floor", "1"), ("call_result_bytes", str(len(pruned) + len(kept)))])
    conn.execute("PRAGMA user_version=3")
    conn.commit()
    conn.close()
    with StateStore.open(state_dir, _generous()) as store:
        # The result an ack had pruned is back, under its seq and below the floor: the record
        # replays it, no replay sends it.
        assert store.call_record(CallKey(LEGACY_SPACE, "k1")).result_frame == pruned
        assert store.call_record(CallKey(LEGACY_SPACE, "k3")).result_frame == kept
        assert [seq for seq, _ in store.events_after(0, 10)] == [2, 3]
        views = dict(((seq, (scope, path)) for seq, scope, path in store._conn.execute("SELECT seq, scope, path FROM events")))
        assert views == {1: ("files:read", UNKNOWN_PATH), 2: ("shell:exec", None), 3: ("files:read", UNKNOWN_PATH)}
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def _generous():
    from sandbox_supervisor.daemon.state.store import CallRetention

    return CallRetention(max_age_s=1e12)
