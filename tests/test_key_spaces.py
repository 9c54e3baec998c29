"""Idempotency key spaces (docs/protocol.md §8, state/keys.py): a socket without
session:control claims keys in a space of its own, so it cannot decide the control plane's
calls by claiming their keys first, and its keyed results are forgotten before the control
plane's, so it cannot push the control plane's records out of the retention budget."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.fields import SESSION_CONTROL
from sandbox_supervisor.daemon.state.keys import LEGACY_SPACE, OWNER_SPACE, CallKey, key_space, owner_key
from sandbox_supervisor.daemon.state.store import DB_FILENAME, SCHEMA_VERSION, _MIGRATIONS, CallRetention, StateStore
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

SECRET = "TOPSECRET-keys-5d1e"
OWNER_SCOPE = f"files:read files:write shell:exec {SESSION_CONTROL}"
CALL_ID = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21"
NOW = 1_700_000_000.0


def as_delegate(client, scope: str = "files:read"):
    """The same client, now holding assertions without session:control."""
    client.scope = scope
    client.state.events.clear()
    client.state.acked = 0
    return client


# -- the pure rule -------------------------------------------------------------------------


def test_session_control_is_the_owner_space_whatever_the_limits():
    assert key_space({SESSION_CONTROL, "files:read"}, None, None) == OWNER_SPACE
    assert key_space({SESSION_CONTROL}, ["src"], ["git"]) == OWNER_SPACE


def test_a_delegated_space_is_named_by_its_bounds_not_their_spelling():
    space = key_space({"files:read", "shell:exec"}, ["src", "lib"], ["git", "ls"])
    assert space != OWNER_SPACE
    assert key_space(["shell:exec", "files:read", "files:read"], ["lib", "src", "src"], ["ls", "git"]) == space
    others = [
        key_space({"files:read"}, ["src", "lib"], ["git", "ls"]),  # fewer scopes
        key_space({"files:read", "shell:exec"}, ["src"], ["git", "ls"]),  # other paths
        key_space({"files:read", "shell:exec"}, None, ["git", "ls"]),  # no path limit
        key_space({"files:read", "shell:exec"}, ["src", "lib"], None),  # no command limit
        key_space({"files:read", "shell:exec"}, ["src", "lib"], []),  # no command at all
    ]
    assert len({space, *others}) == 1 + len(others)


# -- the store -----------------------------------------------------------------------------


def _complete(store: StateStore, key: CallKey, text: str, now: float) -> int:
    body = {"call_id": CALL_ID, "idempotency_key": key.key, "tool_name": "read_file", "ok": True,
            "result": {"content": text}}
    assert store.begin_call(key=key, tool_name="read_file", digest="d", call_id=CALL_ID, intent_json=None, now=now) is None
    return len(store.complete_call(key, body, now=now)[-1].frame.encode())


def _spaces(store: StateStore) -> set[tuple[str, str]]:
    return {(space, key) for space, key in store._conn.execute("SELECT space, key FROM idempotency")}


def test_one_wire_key_is_two_records_in_two_spaces(tmp_path: Path):
    delegated = CallKey(key_space({"files:read"}, ["src"], None), "step-7")
    with StateStore.open(tmp_path / "s") as store:
        _complete(store, delegated, "theirs", NOW)
        # The owner's key is still free: its claim runs, it is not answered from the other record.
        assert store.begin_call(key=owner_key("step-7"), tool_name="read_file", digest="other", call_id=CALL_ID,
                                intent_json=None, now=NOW) is None
        assert store.call_record(delegated).state == "completed"
        assert store.call_record(owner_key("step-7")).state == "pending"


def test_delegated_records_are_forgotten_before_the_owners(tmp_path: Path):
    """Over the budget, every delegated record goes before any of the owner's, even the
    owner's older ones; the owner's go only when the owner's own results exceed it."""
    delegated = key_space({"files:read"}, ["src"], None)
    with StateStore.open(tmp_path / "s", CallRetention(max_age_s=1e12, max_result_bytes=10**9)) as store:
        owner_size = _complete(store, owner_key("deploy"), "x" * 500, NOW)
        sizes = [_complete(store, CallKey(delegated, f"r{i}"), "y" * 500, NOW + 1 + i) for i in range(3)]
    budget = owner_size + sizes[0] + 10  # room for the owner's record and one delegated one
    with StateStore.open(tmp_path / "s", CallRetention(max_age_s=1e12, max_result_bytes=budget)) as store:
        assert _spaces(store) == {(OWNER_SPACE, "deploy"), (delegated, "r2")}
        # One more owner record: now the owner's own results need the room, and the last
        # delegated record goes before the owner's oldest.
        _complete(store, owner_key("build"), "z" * 10, NOW + 10)
        assert _spaces(store) == {(OWNER_SPACE, "deploy"), (OWNER_SPACE, "build")}
        _complete(store, owner_key("test"), "w" * 500, NOW + 11)
        assert _spaces(store) == {(OWNER_SPACE, "build"), (OWNER_SPACE, "test")}
        assert store.call_result_bytes() <= budget


def test_expired_records_of_both_sides_are_forgotten(tmp_path: Path):
    delegated = key_space({"files:read"}, None, None)
    with StateStore.open(tmp_path / "s", CallRetention(max_age_s=100, max_result_bytes=10**9)) as store:
        _complete(store, owner_key("old"), "a", NOW)
        _complete(store, CallKey(delegated, "old"), "b", NOW)
        _complete(store, CallKey(delegated, "new"), "c", NOW + 150)
        assert _spaces(store) == {(delegated, "new")}


def test_a_version_4_database_keeps_its_records_for_every_space(tmp_path: Path):
    """Whose a record written before key spaces existed was is not recorded: migrated into
    the legacy space, it is found (and so replayed) by the same key from the owner's space
    and from a delegated one; nothing new is claimed there."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    for step in _MIGRATIONS[:4]:
        for statement in step:
            statement(conn) if callable(statement) else conn.execute(statement)
    frame = json.dumps({"kind": "tool.result", "seq": 1, "body": {"call_id": CALL_ID, "idempotency_key": "k",
                        "tool_name": "read_file", "ok": True, "result": {"content": "v4"}}}, separators=(",", ":"))
    conn.execute("INSERT INTO events (seq, kind, frame_json, created_at, scope) VALUES (1, 'tool.result', ?, 0, 'files:read')", (frame,))
    conn.execute("INSERT INTO idempotency (key, tool_name, digest, call_id, state, result_seq, created_at, completed_at,"
                 " result_bytes) VALUES ('k', 'read_file', 'd', ?, 'completed', 1, 0, ?, ?)", (CALL_ID, NOW, len(frame)))
    conn.execute("INSERT INTO idempotency (key, tool_name, digest, call_id, state, intent_json, created_at)"
                 " VALUES ('p', 'execute_shell_command', 'd', ?, 'pending', '{}', 0)", (CALL_ID,))
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     [("last_seq", "1"), ("call_result_bytes", str(len(frame)))])
    conn.execute("PRAGMA user_version=4")
    conn.commit()
    conn.close()
    delegated = key_space({"shell:exec"}, None, None)
    with StateStore.open(state_dir, CallRetention(max_age_s=1e12)) as store:
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        for space in (OWNER_SPACE, delegated):
            found = store.begin_call(key=CallKey(space, "k"), tool_name="read_file", digest="d", call_id=CALL_ID,
                                     intent_json=None, now=NOW)
            assert found is not None and found.result_frame == frame and found.space == LEGACY_SPACE
        # Recovery completes a pending legacy record in its own space.
        assert [r.call_key for r in store.pending_calls()] == [CallKey(LEGACY_SPACE, "p")]
        assert _spaces(store) == {(LEGACY_SPACE, "k"), (LEGACY_SPACE, "p")}  # nothing new claimed
        assert store.call_result_bytes() == len(frame)


# -- over the wire -------------------------------------------------------------------------


async def test_a_delegated_socket_cannot_decide_the_owners_future_keyed_call(daemon):
    """Key squatting: a files:read socket limited to src sends the owner's next key with the
    owner's next call. Its path_outside_workspace refusal completes the key in its own space
    only: the owner's real call with that key runs."""
    ws = daemon.layout.workspace
    (ws / "secret").mkdir()
    (ws / "secret" / "x.txt").write_text(SECRET)
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
    async with as_delegate(client).connect(ack_floor=0, claim_overrides={"allowed_paths": ["src"]}) as reader:
        await reader.bootstrap(cwd=str(ws))
        squat = await reader.call_and_wait("read_file", {"path": "secret/x.txt"}, idempotency_key="step-7")
        assert squat["error"]["code"] == errors.PATH_OUTSIDE_WORKSPACE
        assert squat["idempotency_key"] == "step-7"  # echoed as sent, whatever the space
    client.scope = OWNER_SCOPE
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        mine = await owner.call_and_wait("read_file", {"path": "secret/x.txt"}, idempotency_key="step-7")
        assert mine["ok"], mine
        assert mine["result"]["content"] == SECRET


async def test_a_delegated_socket_keeps_exactly_once_in_its_own_space(daemon):
    """Keys still mean exactly once for a delegated socket: a reconnect with the same bounds
    (a new assertion) replays its command instead of running it again."""
    ws = daemon.layout.workspace
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
    command = {"command": "echo ran >> ../delegated.log"}
    for _ in range(2):
        async with as_delegate(client, "shell:exec").connect(ack_floor=0) as worker:
            await worker.bootstrap(cwd=str(ws))
            result = await worker.call_and_wait("execute_shell_command", command, idempotency_key="once")
            assert result["ok"] and result["idempotency_key"] == "once", result
    assert (ws.parent / "delegated.log").read_text() == "ran\n"


async def test_a_delegated_reader_cannot_evict_the_owners_shell_record(tmp_path, authority):
    """Keyed reads of a files:read socket fill idempotency.max_result_bytes; its own records
    are forgotten, never the owner's: the owner's retry replays the command."""
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.settings["idempotency"] = {"max_result_bytes": 8192}
    async with in_process_daemon(layout) as daemon:
        ws = layout.workspace
        (ws / "src").mkdir()
        (ws / "src" / "big.txt").write_text("x" * 3000)
        client = daemon.client()
        command = {"command": "echo ran >> ../ran.log"}
        async with client.connect() as owner:
            await owner.bootstrap(cwd=str(ws))
            assert (await owner.call_and_wait("execute_shell_command", command, idempotency_key="deploy"))["ok"]
        async with as_delegate(client).connect(ack_floor=0, claim_overrides={"allowed_paths": ["src"]}) as reader:
            await reader.bootstrap(cwd=str(ws))
            for i in range(4):
                assert (await reader.call_and_wait("read_file", {"path": "src/big.txt"}, idempotency_key=f"r{i}"))["ok"]
        client.scope = OWNER_SCOPE
        async with client.connect() as owner:
            await owner.bootstrap(cwd=str(ws))
            again = await owner.call_and_wait("execute_shell_command", command, idempotency_key="deploy")
            assert again["ok"], again
        assert (ws.parent / "ran.log").read_text() == "ran\n"
        store = daemon.supervisor.store
        assert store.call_record(owner_key("deploy")) is not None
        assert store.call_result_bytes() <= 8192
