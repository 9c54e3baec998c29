"""A full state directory (docs/operations.md, "Faults and what the daemon does"): the daemon
answers acks, upgrades and calls with typed answers while it is full, starts on it, and
recovers by itself when space returns. The state directory is a real, small tmpfs mounted by
the test (CI runs as root); without mount the tests are skipped with the reason."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from conftest import FAST_WEBSOCKET
from sandbox_supervisor.daemon.exits import EXIT_CONFIG
from sandbox_supervisor.daemon.state import integrity
from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore, StoreFull
from sandbox_supervisor.protocol import errors
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.client import (
    CallNotAnswered,
    ControlClient,
    Endpoint,
    HttpResponse,
    UpgradeRejected,
    http_request,
)
from sandbox_supervisor.testing.daemon import DaemonLayout, DaemonProcess, in_process_daemon, make_layout, running_daemon

# Room for the database, its WAL and a few commands' spools, small enough to fill at once.
TMPFS_SIZE = "4m"
FILL_CHUNK = 64 * 1024
# What the daemon takes to notice freed space (it retries every second), with room for a
# loaded machine.
RECOVERY_DEADLINE_S = 10.0
POLL_S = 0.05
ECHO = {"command": "echo hi"}
HIGH_WATER_RESULT = {
    "call_id": "0b0b0b0b-0000-4000-8000-000000000001",
    "idempotency_key": None,
    "tool_name": "read_file",
    "ok": True,
    "result": {},
}


@pytest.fixture
def tmpfs_layout(tmp_path: Path, authority: LoopbackAuthority) -> Iterator[DaemonLayout]:
    layout = make_layout(tmp_path / "daemon", authority=authority, websocket=dict(FAST_WEBSOCKET))
    state = layout.state_dir
    state.mkdir(mode=0o700)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(state)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc)
        pytest.skip(f"needs a tmpfs mounted as the state directory (root and mount(8)): {detail!r}")
    try:
        yield layout
    finally:
        subprocess.run(["umount", "--lazy", str(state)], check=False, capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte; the filler file, to delete."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        for chunk in (FILL_CHUNK, 1):  # then byte by byte, for what a chunk no longer fits
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


async def first_health(process: DaemonProcess, unix: Endpoint) -> HttpResponse:
    """The first /healthz answer of a daemon started without waiting for listening.json (a
    full disk may refuse that file); fails if the daemon exits first."""
    with trio.fail_after(RECOVERY_DEADLINE_S):
        while True:
            assert process.returncode is None, process.log_text()
            try:
                return await http_request(unix, "GET", "/healthz")
            except OSError:
                await trio.sleep(POLL_S)


async def rejected(client: ControlClient) -> UpgradeRejected:
    with pytest.raises(UpgradeRejected) as refused:
        async with client.connect():
            pass
    return refused.value


async def test_while_full_acks_are_kept_upgrades_get_503_and_all_is_recorded_once_space_returns(
    tmpfs_layout: DaemonLayout,
) -> None:
    layout = tmpfs_layout
    async with in_process_daemon(layout) as daemon:
        assert daemon.supervisor is not None
        store = daemon.supervisor.store
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("execute_shell_command", ECHO, idempotency_key="before")
            floor = client.state.ack_floor
            filler = fill(layout.state_dir)

            # The ack is answered as any ack (nothing sent, the socket open): the ack_ahead
            # error of the next one is the first frame back.
            await session.ack(floor)
            await session.send("events.ack", {"seq": floor + 1000})
            frame = await session.receive()
            assert frame["kind"] == "error" and frame["body"]["code"] == errors.ACK_AHEAD, frame
            assert store.snapshot().ack_floor == 0  # not recorded, so nothing was pruned
            assert daemon.supervisor.journal.deferred_ack == floor

            # An upgrade cannot record its fence: a typed, passing refusal.
            refusal = await rejected(client)
            assert (refusal.status, refusal.error) == (503, errors.STORAGE_FULL)
            assert refusal.header("retry-after") == str(errors.STORAGE_FULL_RETRY_AFTER_S)
            # Readiness says so too (a control plane that connects on /readyz waits), while
            # liveness stays 200: the daemon serves.
            ready = await http_request(daemon.unix, "GET", "/readyz")
            assert ready.status == 503 and ready.json()["checks"]["state"] == "storage_full", ready.json()
            assert (await http_request(daemon.unix, "GET", "/healthz")).status == 200

            # A call cannot be recorded: refused before it runs, its key left free.
            with pytest.raises(CallNotAnswered) as refused:
                await session.result(await session.call("execute_shell_command", ECHO, idempotency_key="during"))
            assert refused.value.retryable

            filler.unlink()
            # Ready again once space is freed, before any upgrade succeeds (none is needed).
            assert (await http_request(daemon.unix, "GET", "/readyz")).status == 200
            # The kept ack is written by the daemon itself, with no new ack from the client.
            with trio.fail_after(RECOVERY_DEADLINE_S):
                while store.snapshot().ack_floor != floor:
                    await trio.sleep(POLL_S)
            assert daemon.supervisor.journal.deferred_ack == 0

            # The refused call runs now, once, under the key it was refused with.
            result = await session.call_and_wait("execute_shell_command", ECHO, idempotency_key="during")
            assert result["ok"] and result["result"]["exit_code"] == 0
        async with client.connect() as session:  # the fence is recorded again
            await session.bootstrap(cwd=str(layout.workspace))
        results = [
            frame for frame in client.state.events.values()
            if frame["kind"] == "tool.result" and frame["body"].get("idempotency_key") == "during"
        ]
        assert len(results) == 1


async def test_a_daemon_started_on_a_full_disk_serves_refusals_and_opens_its_state_when_space_returns(
    tmpfs_layout: DaemonLayout,
) -> None:
    layout = tmpfs_layout
    unix = Endpoint(unix=str(layout.unix_socket))  # outside the full tmpfs: no listening.json needed
    async with running_daemon(layout) as process:
        client = ControlClient(unix, layout.authority, sandbox_id=layout.sandbox_id)
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
        assert await process.stop() == 0  # a clean stop: sqlite removes its -wal and -shm
        filler = fill(layout.state_dir)

        await process.start(wait_ready=False)
        health = await first_health(process, unix)
        assert health.status == 503 and health.json()["status"] == "storage_full"
        refusal = await rejected(client)
        assert (refusal.status, refusal.error) == (503, errors.STORAGE_FULL)
        assert refusal.header("retry-after") == str(errors.STORAGE_FULL_RETRY_AFTER_S)
        ready = await http_request(unix, "GET", "/readyz")
        assert ready.status == 503
        assert ready.json()["checks"] == {"state": "storage_full", "keys": "ok", "sandboxId": "ok"}

        filler.unlink()
        with trio.fail_after(RECOVERY_DEADLINE_S):
            while (await http_request(unix, "GET", "/healthz")).status != 200:
                await trio.sleep(POLL_S)
        assert (await http_request(unix, "GET", "/readyz")).status == 200
        async with client.connect() as session:
            state = await session.bootstrap(cwd=str(layout.workspace))
            assert state["body"]["sessionId"] == client.session_id  # the same state, bound
            result = await session.call_and_wait("execute_shell_command", ECHO, idempotency_key="after")
            assert result["ok"], result["error"]
        assert process.returncode is None  # recovered without a restart
    events = [event["event"] for event in process.log_events()]
    assert "supervisor.storage_full" in events
    assert events.count("supervisor.ready") == 2  # the first run, then this one once opened


async def test_a_daemon_waiting_for_space_stops_cleanly_on_sigterm(tmpfs_layout: DaemonLayout) -> None:
    layout = tmpfs_layout
    fill(layout.state_dir)  # before the first start: not even a database yet
    unix = Endpoint(unix=str(layout.unix_socket))
    async with running_daemon(layout, wait_ready=False) as process:
        assert (await first_health(process, unix)).json()["status"] == "storage_full"
        assert await process.stop() == 0
    stopped = [event["reason"] for event in process.log_events() if event["event"] == "supervisor.stopped"]
    assert stopped == ["SIGTERM"]


# --- a full disk and the start-up integrity check (state/integrity.py) --------------------
# A full disk is a passing fault (wait), a damaged state a permanent one (exit 2): neither may
# be taken for the other, and the daemon never starts fresh on either.

REFUSAL = "supervisor.state_refused"


async def _bootstrapped_then_stopped(layout: DaemonLayout) -> DaemonProcess:
    """A sandbox that has had state (bound, one command), stopped cleanly: sqlite removed its
    -wal and -shm, so the next open needs room for a new -shm."""
    unix = Endpoint(unix=str(layout.unix_socket))
    async with running_daemon(layout) as process:
        client = ControlClient(unix, layout.authority, sandbox_id=layout.sandbox_id)
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            assert (await session.call_and_wait("execute_shell_command", ECHO, idempotency_key="k"))["ok"]
        assert await process.stop() == 0
    return process


def _refusals(process: DaemonProcess) -> list[dict]:
    return [event for event in process.log_events() if event["event"] == REFUSAL]


async def test_a_damaged_state_on_a_full_disk_is_refused_once_readable_never_started_fresh(
    tmpfs_layout: DaemonLayout,
) -> None:
    from test_state_integrity import _garble_root_page

    layout = tmpfs_layout
    process = await _bootstrapped_then_stopped(layout)
    marker = integrity.read_marker(layout.state_dir)
    _garble_root_page(layout.state_dir / DB_FILENAME, "events")
    filler = fill(layout.state_dir)
    layout.log_file.unlink(missing_ok=True)

    await process.start(wait_ready=False)
    # sqlite needs room for the -shm index before it can read a page: the daemon waits,
    # answering health, rather than calling a state it could not read damaged ...
    health = await first_health(process, Endpoint(unix=str(layout.unix_socket)))
    assert health.status == 503 and health.json()["status"] == "storage_full"
    assert process.returncode is None and not _refusals(process)
    # ... and once it can read it, refuses it: exit 2, one JSON line, no traceback.
    filler.unlink()
    assert await process.wait(RECOVERY_DEADLINE_S) == EXIT_CONFIG
    text = process.log_text()
    assert "Traceback" not in text, text
    refusals = _refusals(process)
    assert len(refusals) == 1 and refusals[0]["problem"] == integrity.DAMAGED, text
    assert "supervisor.ready" not in [event["event"] for event in process.log_events()]
    assert integrity.read_marker(layout.state_dir) == marker  # nothing started fresh


async def test_a_missing_database_on_a_full_disk_is_refused_at_once(tmpfs_layout: DaemonLayout) -> None:
    layout = tmpfs_layout
    process = await _bootstrapped_then_stopped(layout)
    (layout.state_dir / DB_FILENAME).unlink()
    fill(layout.state_dir)
    layout.log_file.unlink(missing_ok=True)
    await process.start(wait_ready=False)
    # No wait for space: that the database is gone needs no room to see.
    assert await process.wait(RECOVERY_DEADLINE_S) == EXIT_CONFIG
    events = [event["event"] for event in process.log_events()]
    assert [event["problem"] for event in _refusals(process)] == [integrity.MISSING]
    assert "supervisor.storage_full" not in events and "supervisor.ready" not in events
    assert not (layout.state_dir / DB_FILENAME).exists()  # nothing created


def test_an_instance_file_the_full_disk_refuses_is_a_wait_then_written_with_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"

    def full(state_dir: Path, marker: integrity.Marker) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(integrity, "write_marker", full)
        with pytest.raises(StoreFull):  # never StateRefused, never a start without the file
            StateStore.open(state_dir)
    assert integrity.read_marker(state_dir) is None
    with sqlite3.connect(state_dir / DB_FILENAME) as conn:
        (committed,) = conn.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()
    conn.close()
    StateStore.open(state_dir).close()  # space again: the id already committed is adopted
    marker = integrity.read_marker(state_dir)
    assert marker is not None and marker.instance_id == committed


def test_a_high_water_mark_the_full_disk_refused_at_open_follows_commits_once_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The edge where the disk fills between instance.json and the mark (sqlite itself cannot
    # open a database on a full disk: that start waits), injected at the mark's open.
    state_dir = tmp_path / "state"
    StateStore.open(state_dir).close()
    (state_dir / integrity.HIGH_WATER_FILE).unlink()

    def full(cls: type, state_dir: Path, value: int) -> integrity.HighWater:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(integrity.HighWater, "open", classmethod(full))
        store = StateStore.open(state_dir)  # the daemon still starts: the state is sound
    with store:
        assert integrity.HighWater.read(state_dir) == 0
        rows = store.append_events([("tool.result", HIGH_WATER_RESULT)])  # room again
        assert integrity.HighWater.read(state_dir) == rows[-1].seq == 1
        rows = store.append_events([("tool.result", HIGH_WATER_RESULT)])
        assert integrity.HighWater.read(state_dir) == rows[-1].seq == 2


def test_a_full_disk_during_quick_check_is_a_wait_not_damage(tmp_path: Path) -> None:
    # Reading a WAL database needs room for its -shm index (SQLITE_IOERR_SHMSIZE); on this
    # machine sqlite already fails earlier on a full disk (at open), so the error is given to
    # the check directly, as sqlite raises it.
    class FullDisk:
        def execute(self, sql: str) -> None:
            exc = sqlite3.OperationalError("disk I/O error")
            exc.sqlite_errorname = "SQLITE_IOERR_SHMSIZE"  # type: ignore[attr-defined]
            raise exc

    with pytest.raises(sqlite3.OperationalError):  # not StateRefused: the caller waits
        integrity.quick_check(FullDisk(), tmp_path)  # type: ignore[arg-type]
    broken = sqlite3.OperationalError("disk I/O error")

    class Broken:
        def execute(self, sql: str) -> None:
            raise broken

    with pytest.raises(integrity.StateRefused):  # any other error: damaged, as before
        integrity.quick_check(Broken(), tmp_path)  # type: ignore[arg-type]
