"""Exactly once under lost responses and kill -9 (docs/protocol.md §8, §10.2).

These drive a real daemon subprocess, started as users start it, through the reference
client; the daemon is killed with SIGKILL and restarted on the same state directory.
"""

from __future__ import annotations

import random
import signal
import sqlite3

import trio
import trio_websocket

from sandbox_supervisor.daemon.state.store import DB_FILENAME
from sandbox_supervisor.testing.client import UpgradeRejected
from sandbox_supervisor.testing.daemon import DaemonProcess, make_layout, running_daemon
from sandbox_supervisor.daemon.runtime.patch import git_blob_sha  # checked against `git hash-object` in test_patch

ZERO = "0" * 40
RETRIES = 3
DISCONNECTED = (trio_websocket.ConnectionClosed, OSError, trio.TooSlowError, UpgradeRejected, trio.BrokenResourceError)


def create_params(path: str, text: str) -> dict:
    return {
        "path": path,
        "diff": f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{text}\n",
        "base_sha": ZERO,
    }


def append_params(path: str, lines: list[str], new_line: str) -> dict:
    old = "".join(f"{line}\n" for line in lines).encode()
    n = len(lines)
    if n == 0:
        return create_params(path, new_line)
    diff = f"--- a/{path}\n+++ b/{path}\n@@ -{n},1 +{n},2 @@\n {lines[-1]}\n+{new_line}\n"
    return {"path": path, "diff": diff, "base_sha": git_blob_sha(old)}


def journal_rows(state_dir):
    conn = sqlite3.connect(state_dir / DB_FILENAME)
    try:
        events = conn.execute("SELECT seq, kind, frame_json FROM events ORDER BY seq").fetchall()
        # The journal's last seq as the store reads it (state/store.py `_last_seq_in`): an
        # append writes no meta row, meta's value is kept for when the newest events are gone.
        last = conn.execute(
            "SELECT MAX(COALESCE((SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'last_seq'), 0),"
            " COALESCE((SELECT MAX(seq) FROM events), 0))"
        ).fetchone()
        pending = conn.execute("SELECT COUNT(*) FROM idempotency WHERE state = 'pending'").fetchone()[0]
    finally:
        conn.close()
    return events, int(last[0]) if last else 0, pending


class Driver:
    """A control plane that retries with the same key until it gets the call's result,
    reconnecting (and restarting a dead daemon) as needed."""

    def __init__(self, process: DaemonProcess, running) -> None:
        self.process = process
        self.running = running
        self.client = running.client()
        self.cwd = str(process.layout.workspace)
        self.sent = 0
        self.restarts = 0

    async def ensure_daemon(self) -> None:
        if self.process.proc.poll() is not None:
            self.check_files()
            running = await self.process.start()
            self.client.endpoint = running.tcp
            self.restarts += 1

    def check_files(self) -> None:
        """Called while the daemon is dead: no file is torn."""

    async def call(self, params: dict, key: str, *, lose: float = 0.0, rng=None, kill_after=None) -> dict:
        for attempt in range(RETRIES + 1):
            await self.ensure_daemon()
            try:
                async with self.client.connect() as session:
                    await session.bootstrap(cwd=self.cwd)
                    call_id = await session.call("apply_file_patch", params, idempotency_key=key)
                    self.sent += 1
                    if kill_after is not None and attempt == 0:
                        await trio.sleep(kill_after)
                        self.process.send_signal(signal.SIGKILL)
                        await self.process.wait()
                    if rng is not None and attempt < RETRIES and rng.random() < lose:
                        continue  # the response is lost: drop the connection unread
                    return await session.result(call_id, timeout=10)
            except DISCONNECTED:
                continue
        raise AssertionError(f"no result for {key} after {RETRIES} retries")


async def test_1000_calls_with_lost_responses_and_a_kill_9_in_the_middle(tmp_path, authority):
    """1,000 patch calls, 20 % of responses lost, up to three retries with the same key, and
    the daemon killed with SIGKILL once in the middle: every call executes exactly once."""
    rng = random.Random(1)
    layout = make_layout(tmp_path / "d", authority=authority)
    # The driver kills and restarts this same process mid-body; leaving stops the current run.
    async with running_daemon(layout) as process:
        driver = Driver(process, process.running)
        calls = 1000
        for k in range(calls):
            kill_after = 0.0 if k == calls // 2 else None
            await driver.call(create_params(f"f/{k}.txt", f"value {k}"), f"k-{k}", lose=0.2, rng=rng, kill_after=kill_after)
        # Collect every result from the journal (the client never acked, nothing was pruned).
        await driver.ensure_daemon()
        async with driver.client.connect(ack_floor=0) as session:
            state = await session.bootstrap(cwd=driver.cwd)
            last = state["body"]["localEventMax"]
            while max(driver.client.state.events, default=0) < last:
                await session.receive()
    assert process.returncode == 0

    results = [f["body"] for f in driver.client.state.events.values() if f["kind"] == "tool.result"]
    per_key: dict[str, int] = {}
    for body in results:
        per_key[body["idempotency_key"]] = per_key.get(body["idempotency_key"], 0) + 1
    executed = sum(1 for body in results if body["ok"])
    duplicates = sum(count - 1 for count in per_key.values())
    print(f"sent {driver.sent}, executed {executed}, duplicates {duplicates}")
    assert driver.sent > calls  # responses were lost and retried
    assert driver.restarts == 1
    assert executed == calls and duplicates == 0 and len(per_key) == calls
    for k in range(calls):
        assert (layout.workspace / f"f/{k}.txt").read_text() == f"value {k}\n"
    events, last_seq, pending = journal_rows(layout.state_dir)
    assert [seq for seq, _, _ in events] == list(range(1, last_seq + 1))
    assert pending == 0


async def test_random_kill_9_while_patches_flow(tmp_path, authority):
    """A daemon killed at random moments while a chain of dependent patches is applied:
    after each restart no file is torn; at the end every patch applied exactly once and the
    journal is dense."""
    rng = random.Random(20)
    layout = make_layout(tmp_path / "d", authority=authority)
    ledger = layout.workspace / "ledger.txt"
    lines: list[str] = []

    class CrashDriver(Driver):
        def check_files(self) -> None:
            data = ledger.read_bytes() if ledger.exists() else b""
            text = data.decode()
            assert text == "".join(f"{line}\n" for line in text.splitlines()), "torn file"
            valid = ["".join(f"line {i}\n" for i in range(n)) for n in range(len(lines) + 2)]
            assert text in valid, "the ledger is not a prefix of the applied patches"

    # The driver kills and restarts this same process mid-body; leaving stops the current run.
    async with running_daemon(layout) as process:
        driver = CrashDriver(process, process.running)
        kills = 0
        for k in range(40):
            kill_after = rng.uniform(0, 0.008) if rng.random() < 0.5 else None
            kills += kill_after is not None
            result = await driver.call(append_params("ledger.txt", lines, f"line {k}"), f"ledger-{k}", kill_after=kill_after)
            assert result["ok"] is True, result
            lines.append(f"line {k}")
    assert process.returncode == 0
    assert ledger.read_text() == "".join(f"line {k}\n" for k in range(40))
    assert driver.restarts == kills >= 10
    events, last_seq, pending = journal_rows(layout.state_dir)
    assert [seq for seq, _, _ in events] == list(range(1, last_seq + 1))
    assert pending == 0
    import json

    per_key: dict[str, int] = {}
    for _, kind, frame_json in events:
        if kind == "tool.result":
            key = json.loads(frame_json)["body"]["idempotency_key"]
            per_key[key] = per_key.get(key, 0) + 1
    assert per_key == {f"ledger-{k}": 1 for k in range(40)}
    # Some kills landed while a call was in flight: its record was found pending at start.
    recovered = [e for e in process.log_events() if e.get("event") == "calls.recovered"]
    print(f"kills {kills}, starts that recovered pending calls {len(recovered)}")
    assert recovered
