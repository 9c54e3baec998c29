"""Review of 32632c6 (idempotency keys by key space): ways a socket without session:control
can still decide or evict the control plane's keyed calls. Each test states the behaviour the
key-space split promises."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.fields import SESSION_CONTROL
from sandbox_supervisor.daemon.runtime import calls
from sandbox_supervisor.daemon.state.keys import owner_key
from sandbox_supervisor.daemon.state.store import _MIGRATIONS, _PROCESSES_TABLE, DB_FILENAME
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

OWNER_SCOPE = f"files:read files:write shell:exec {SESSION_CONTROL}"


def as_delegate(client, scope: str):
    """The same client, now holding assertions without session:control."""
    client.scope = scope
    client.state.events.clear()
    client.state.acked = 0
    return client


def as_owner(client):
    client.scope = OWNER_SCOPE
    return client


async def test_a_delegated_socket_cannot_decide_the_owners_keyed_command_through_its_call_id(daemon):
    """The key-space split means a delegate cannot pre-decide the owner's keyed call. The
    spool (and so the 'call_id was already used' check) is shared by every space, and that
    refusal completes the key: squatting the owner's call_id decides the owner's key just as
    squatting the key did before 32632c6. The delegate here may run only `echo`, so it has no
    other way to touch the owner's commands; it needs only the owner's next call_id (one it
    saw in a public refusal that the owner resends, say)."""
    ws = daemon.layout.workspace
    client = daemon.client()
    async with as_owner(client).connect() as owner:
        await owner.bootstrap(cwd=str(ws))
    owners_next = str(uuid.uuid4())  # e.g. a call_id the owner resends after a refusal
    # A delegate limited to `echo`: it can neither see the owner's commands nor run its own.
    limited = {"allowed_commands": ["echo"]}
    async with as_delegate(client, "shell:exec").connect(ack_floor=0, claim_overrides=limited) as worker:
        await worker.bootstrap(cwd=str(ws))
        squat = await worker.call_and_wait(
            "execute_shell_command", {"command": "echo hi"}, idempotency_key="squat", call_id=owners_next
        )
        assert squat["ok"], squat
    command = {"command": "echo ran >> ../ran.log"}
    async with as_owner(client).connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        first = await owner.call_and_wait("execute_shell_command", command, idempotency_key="deploy", call_id=owners_next)
        # The owner's own attempt is refused (its call_id is taken): that much is fair.
        assert first["error"]["code"] == errors.INVALID_PARAMETERS
        # But the refusal ran nothing and must not decide the key: a retry with a fresh
        # call_id runs the command.
        retry = await owner.call_and_wait("execute_shell_command", command, idempotency_key="deploy")
        assert retry["ok"], retry
    assert (ws.parent / "ran.log").read_text() == "ran\n"


async def test_a_delegated_socket_cannot_evict_the_owners_unjournaled_result(daemon, monkeypatch):
    """A result the database refused is kept in memory until its key comes back (§8). The
    store's budget forgets delegated records first; the in-memory bound does not, so keyed
    reads of a delegated socket during the outage drop the owner's kept result and the
    owner's record stays pending. (The bound is lowered to two results to keep the test
    small; at the shipped 1,024 results / 8 Mi characters the same holds with more reads.)"""
    monkeypatch.setattr(calls, "MAX_UNJOURNALED", 2)
    ws = daemon.layout.workspace
    (ws / "big.txt").write_bytes(b"x" * 65536)
    conn = daemon.supervisor.store._conn  # the daemon's own connection: its limit, its error
    client = daemon.client()
    async with as_owner(client).connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        # Room for the small rows a claim writes, not for a 64 KiB result (a full disk).
        conn.execute(f"PRAGMA max_page_count = {pages + 6}")
        mine = await owner.call("read_file", {"path": "big.txt"}, idempotency_key="owners")
        refused = await owner.receive_until(lambda f: f["kind"] == "error" and f["body"].get("call_id") == mine)
        assert refused["body"]["code"] == errors.INTERNAL
    assert owner_key("owners") in daemon.supervisor.runtime.calls.unjournaled
    async with as_delegate(client, "files:read").connect(ack_floor=0) as reader:
        await reader.bootstrap(cwd=str(ws))
        for i in range(2):
            theirs = await reader.call("read_file", {"path": "big.txt"}, idempotency_key=f"r{i}")
            await reader.receive_until(lambda f: f["kind"] == "error" and f["body"].get("call_id") == theirs)
    conn.execute("PRAGMA max_page_count = 1073741823")  # room again
    async with as_owner(client).connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        retry = await owner.call("read_file", {"path": "big.txt"}, idempotency_key="owners")
        with trio.fail_after(10):
            answer = await owner.receive_until(
                lambda f: f["kind"] in ("tool.replayed", "tool.pending", "error") and f["body"].get("call_id") == retry
            )
        assert answer["kind"] == "tool.replayed", answer
        assert answer["body"]["original"]["body"]["call_id"] == mine


def _downgrade_to_v4(db: Path) -> None:
    """Rewrite the idempotency table as schema 4 had it (one key namespace, no space), as a
    daemon of the previous release would have left it, and mark the database version 4."""
    conn = sqlite3.connect(db)
    statements = [
        step for step in _MIGRATIONS[3] if isinstance(step, str) and "idempotency" in step and "events" not in step
    ]
    with conn:
        conn.execute("ALTER TABLE idempotency RENAME TO idempotency_v5")
        for statement in statements:
            if statement.startswith("INSERT INTO idempotency_v4"):
                statement = statement.replace("FROM idempotency", "FROM idempotency_v5")
            if statement.startswith("DROP TABLE"):
                statement = "DROP TABLE idempotency_v5"
            conn.execute(statement)
        conn.execute("DROP TABLE IF EXISTS held")  # schema 6's, unknown to schema 4
        # Schema 8's processes.cgroup, unknown to schema 4 (rebuilt: sqlite before 3.35 has
        # no DROP COLUMN).
        conn.execute("ALTER TABLE processes RENAME TO processes_v8")
        conn.execute(_PROCESSES_TABLE)
        conn.execute(
            "INSERT INTO processes SELECT call_id, pid, pgid, start_ticks, recorded_at FROM processes_v8"
        )
        conn.execute("DROP TABLE processes_v8")
        conn.execute("PRAGMA user_version=4")
    assert [row[1] for row in conn.execute("PRAGMA table_info(idempotency)")][0] == "key"
    conn.close()


async def test_a_delegated_keyed_command_is_not_run_again_across_the_upgrade(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    ws = layout.workspace
    command = {"command": "echo ran >> ../delegated.log"}
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with as_owner(client).connect() as owner:
            await owner.bootstrap(cwd=str(ws))
        async with as_delegate(client, "shell:exec").connect(ack_floor=0) as worker:
            await worker.bootstrap(cwd=str(ws))
            assert (await worker.call_and_wait("execute_shell_command", command, idempotency_key="once"))["ok"]
        generation = client.state.generation
    _downgrade_to_v4(layout.state_dir / DB_FILENAME)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        client.state.generation = generation  # the fence survives the restart
        async with as_delegate(client, "shell:exec").connect(ack_floor=0) as worker:
            await worker.bootstrap(cwd=str(ws))
            again = await worker.call_and_wait("execute_shell_command", command, idempotency_key="once")
            assert again["ok"], again
    assert (ws.parent / "delegated.log").read_text() == "ran\n"  # exactly once across the upgrade
