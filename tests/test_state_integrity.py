"""Damaged, missing or inconsistent state: the daemon refuses to start (exit 2, one JSON line
saying what is wrong and what to do), never starts fresh silently and never shows a
traceback; `reset-state` is the explicit way to start afresh; recovery removes the temporary
files a kill left (docs/operations.md, "Faults and what the daemon does").

Every daemon here is the real one, started as users start it (`running_daemon`), on real
sqlite files damaged the way the faults damage them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.exits import EXIT_CONFIG
from sandbox_supervisor.daemon.runtime import spool
from sandbox_supervisor.daemon.runtime.patch import TEMP_SUFFIX
from sandbox_supervisor.daemon.state import integrity
from sandbox_supervisor.daemon.state.keys import CallKey, OWNER_SPACE
from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore
from sandbox_supervisor.testing.daemon import DaemonLayout, DaemonProcess, make_layout, running_daemon

REFUSAL = "supervisor.state_refused"
ZERO_SHA = "0" * 40


async def _with_history(tmp_path: Path, authority, *, kill: bool = False) -> DaemonLayout:
    """A sandbox that has had state: bound, two keyed commands run (spooled output, events,
    idempotency records). Stopped cleanly (the -wal checkpointed away), or killed with
    SIGKILL (its -wal still hot) when `kill`."""
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for n in range(2):
                result = await session.call_and_wait(
                    "execute_shell_command", {"command": f"echo out-{n}"}, idempotency_key=f"k{n}"
                )
                assert result["ok"] is True, result
        if kill:
            await process.kill()
    assert (layout.state_dir / integrity.INSTANCE_FILE).exists()
    return layout


async def _refused(layout: DaemonLayout) -> dict:
    """Start the daemon and expect a refusal: exit 2, one JSON refusal line, no traceback,
    nothing but JSON in its log; returns the refusal."""
    layout.log_file.unlink(missing_ok=True)
    process = DaemonProcess(layout)
    await process.start(wait_ready=False)
    code = await process.wait(20)
    text = process.log_text()
    assert code == EXIT_CONFIG, text
    assert "Traceback" not in text, text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    refusals = [line for line in lines if line["event"] == REFUSAL]
    assert len(refusals) == 1, text
    assert [line for line in lines if line["level"] == "error"] == refusals
    assert not (layout.state_dir / "listening.json").exists()  # it never served
    refusal = refusals[0]
    assert "reset-state" in refusal["action"]
    return refusal


def _reset(layout: DaemonLayout) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", "reset-state", "--config", str(layout.config_file)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    moved = sorted(layout.state_dir.glob(f"{integrity.DAMAGED_PREFIX}*"))
    assert len(moved) == 1 and str(moved[0]) in done.stdout
    return moved[0]


async def _starts_fresh(layout: DaemonLayout, moved: Path) -> None:
    """After the reset the daemon starts as a new sandbox: a new instance, a new journal."""
    async with running_daemon(layout) as process:
        async with process.running.client().connect(ack_floor=0) as session:
            state = await session.bootstrap(cwd=str(layout.workspace))
            # Only what this bootstrap journaled (the old journal had two commands' events).
            assert state["body"]["localEventMax"] <= 1
    assert process.returncode == 0
    old = integrity.read_marker(moved)
    new = integrity.read_marker(layout.state_dir)
    assert new is not None and (old is None or old.instance_id != new.instance_id)


def _garble_root_page(db: Path, name: str) -> None:
    """Overwrite the b-tree root page of table or index `name` with junk, as a bad sector or
    a stray write would."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0
    with open(db, "r+b") as handle:
        handle.seek((root - 1) * page_size)
        handle.write(bytes([0xA5]) * page_size)


@pytest.mark.parametrize("fault", ["truncated", "deleted"])
async def test_a_missing_database_is_refused_and_reset_state_starts_afresh(tmp_path, authority, fault):
    layout = await _with_history(tmp_path, authority)
    db = layout.state_dir / DB_FILENAME
    if fault == "truncated":
        os.truncate(db, 0)
    else:
        db.unlink()
    refusal = await _refused(layout)
    assert refusal["problem"] == integrity.MISSING
    assert DB_FILENAME in refusal["detail"]
    # The refusal changed nothing: still refused on the next try.
    assert not db.exists() or db.stat().st_size == 0
    await _refused(layout)
    moved = _reset(layout)
    assert (moved / integrity.INSTANCE_FILE).exists() and (moved / spool.SPOOL_DIRECTORY).is_dir()
    await _starts_fresh(layout, moved)


async def test_a_deleted_hot_wal_after_a_kill_is_refused(tmp_path, authority):
    layout = await _with_history(tmp_path, authority, kill=True)
    wal = layout.state_dir / f"{DB_FILENAME}-wal"
    assert wal.stat().st_size > 0  # hot: the bootstrap and the calls are only in it
    wal.unlink()
    refusal = await _refused(layout)
    assert refusal["problem"] == integrity.INCONSISTENT
    assert integrity.HIGH_WATER_FILE in refusal["detail"]
    moved = _reset(layout)
    await _starts_fresh(layout, moved)


@pytest.mark.parametrize("name", ["events", "idempotency", "idempotency_pending"])
async def test_a_garbled_page_is_refused(tmp_path, authority, name):
    layout = await _with_history(tmp_path, authority)
    _garble_root_page(layout.state_dir / DB_FILENAME, name)
    refusal = await _refused(layout)
    assert refusal["problem"] == integrity.DAMAGED
    moved = _reset(layout)
    assert (moved / DB_FILENAME).stat().st_size > 0  # kept for whoever investigates
    await _starts_fresh(layout, moved)


async def test_a_new_state_directory_starts_fresh_and_records_its_instance(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        marker = integrity.read_marker(layout.state_dir)
        assert marker is not None
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="k")
            last = session.client.state.max_seq
    assert process.returncode == 0
    # A clean restart of the same state is not refused.
    async with running_daemon(layout) as process:
        assert integrity.read_marker(layout.state_dir) == marker
    assert process.returncode == 0
    # The high-water mark followed the journal.
    assert int((layout.state_dir / integrity.HIGH_WATER_FILE).read_text()) == last > 0


async def test_spooled_output_without_a_database_is_refused(tmp_path, authority):
    """A state directory from before instance.json existed, whose database was deleted: the
    spooled output says it had state."""
    layout = await _with_history(tmp_path, authority)
    for name in (DB_FILENAME, integrity.INSTANCE_FILE):
        (layout.state_dir / name).unlink()
    refusal = await _refused(layout)
    assert refusal["problem"] == integrity.MISSING
    assert spool.SPOOL_DIRECTORY in refusal["detail"]


def test_the_spool_directory_name_is_the_spools():
    assert integrity.SPOOL_DIRECTORY == spool.SPOOL_DIRECTORY


# -- leftovers ---------------------------------------------------------------------------


async def test_recovery_removes_the_temporary_files_a_kill_left(tmp_path, authority):
    """A kill between a temp file's creation and its rename leaves `.<name>.<hex>.patch-tmp`
    beside a patched file (in the agent's repository) and `.stdout.state.<hex>.tmp` in the
    spool: the next start removes exactly those, and nothing of the agent's."""
    layout = await _with_history(tmp_path, authority)
    workspace = layout.workspace
    (workspace / "notes.txt").write_text("old\n")
    # The state a kill during a keyed patch of notes.txt leaves: its pending record, and the
    # temp file of the write it was doing.
    store = StateStore.open(layout.state_dir)
    try:
        params = {
            "path": "notes.txt",
            "diff": "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-old\n+new\n",
            "base_sha": _git_sha(b"old\n"),
        }
        binding = store.binding()
        assert binding is not None
        store.begin_call(
            key=CallKey(OWNER_SPACE, "patch-1"),
            tool_name="apply_file_patch",
            digest="d",
            call_id="0b0b0b0b-0000-4000-8000-000000000001",
            intent_json=json.dumps(
                {"parameters": params, "cwd": str(workspace), "allowed_paths": None, "allowed_commands": None,
                 "session_id": binding.session_id, "generation": 1}
            ),
        )
    finally:
        store.close()
    leftover = workspace / f".notes.txt.{'ab' * 8}{TEMP_SUFFIX}"
    leftover.write_text("new\n")
    # The agent's own files, even ones that look alike, stay.
    agent_files = [
        workspace / f".other.txt.{'ab' * 8}{TEMP_SUFFIX}",  # not a patched file's
        workspace / f".notes.txt.{'ab' * 7}{TEMP_SUFFIX}",  # not our random part
        workspace / "notes.txt.patch-tmp",
    ]
    for path in agent_files:
        path.write_text("agent\n")
    call_dir = next((layout.state_dir / spool.SPOOL_DIRECTORY).iterdir())
    spool_leftovers = [call_dir / f".stdout.state.{'cd' * 6}.tmp", call_dir / f".exit.json.{'ef' * 6}.tmp"]
    for path in spool_leftovers:
        path.write_bytes(b"")
    not_ours = call_dir / ".stdout.state.tmp"
    not_ours.write_bytes(b"")

    async with running_daemon(layout) as process:
        events = process.log_events()
    assert process.returncode == 0
    assert not leftover.exists()
    assert (workspace / "notes.txt").read_text() == "new\n"  # the pending patch was recovered
    assert all(path.exists() for path in agent_files)
    assert not any(path.exists() for path in spool_leftovers)
    assert not_ours.exists()
    removed = {e["where"]: e["files"] for e in events if e["event"] == "recovery.leftovers_removed"}
    assert removed == {"workspace": 1, "spool": 2}


def test_spool_leftovers_of_a_live_holder_and_new_files_stay(tmp_path):
    """A held process's holder outlives the daemon and may be writing a record right now:
    its directory is skipped; so is any temp file newer than the daemon's start."""
    state_dir = tmp_path / "state"
    live, dead = "0b0b0b0b-0000-4000-8000-00000000000a", "0b0b0b0b-0000-4000-8000-00000000000b"
    for call_id in (live, dead):
        spool.spool_dir(state_dir, call_id).mkdir(parents=True)
    held = spool.spool_dir(state_dir, live) / f".exit.json.{'12' * 6}.tmp"
    old = spool.spool_dir(state_dir, dead) / f".stderr.state.{'34' * 6}.tmp"
    new = spool.spool_dir(state_dir, dead) / f".stdout.state.{'56' * 6}.tmp"
    for path in (held, old, new):
        path.write_bytes(b"")
    past = time.time() - 60
    os.utime(held, (past, past))
    os.utime(old, (past, past))
    removed = spool.remove_leftover_temporaries(state_dir, keep={live}, older_than=time.time() - 30)
    assert removed == 1
    assert held.exists() and new.exists() and not old.exists()


def _git_sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# -- the store's checks, directly ----------------------------------------------------------


RESULT = {"call_id": "0b0b0b0b-0000-4000-8000-000000000001", "idempotency_key": None, "tool_name": "read_file", "ok": True, "result": {}}


def test_a_deleted_instance_file_is_written_again_from_the_database(tmp_path):
    state_dir = tmp_path / "state"
    StateStore.open(state_dir).close()
    marker = integrity.read_marker(state_dir)
    (state_dir / integrity.INSTANCE_FILE).unlink()
    StateStore.open(state_dir).close()
    restored = integrity.read_marker(state_dir)
    assert marker is not None and restored is not None and restored.instance_id == marker.instance_id


def test_another_instances_database_is_refused(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    StateStore.open(first).close()
    StateStore.open(second).close()
    os.replace(second / DB_FILENAME, first / DB_FILENAME)
    with pytest.raises(integrity.StateRefused) as refused:
        StateStore.open(first)
    assert refused.value.problem == integrity.INCONSISTENT


def test_the_high_water_mark_follows_commits_only(tmp_path):
    state_dir = tmp_path / "state"
    StateStore.open(state_dir).close()
    assert integrity.HighWater.read(state_dir) == 0
    with StateStore.open(state_dir) as store:
        with pytest.raises(ValueError):  # refused before any write: nothing committed
            store.append_events([("no.such.kind", {})])
        assert integrity.HighWater.read(state_dir) == 0
        rows = store.append_events([("tool.result", RESULT)])
        assert integrity.HighWater.read(state_dir) == rows[-1].seq == 1
    # A mark ahead of the database (its last commits lost) is refused.
    (state_dir / integrity.HIGH_WATER_FILE).write_text(f"{5:020d}\n")
    with pytest.raises(integrity.StateRefused) as refused:
        StateStore.open(state_dir)
    assert refused.value.problem == integrity.INCONSISTENT
