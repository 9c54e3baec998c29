"""ShellRuntime without a daemon: real shells, a real sqlite journal, the runtime's own nursery."""

from __future__ import annotations

import signal
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.daemon.runtime.tool import RunningCall
from sandbox_supervisor.daemon.runtime.command_output import StreamOutput
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from shell_support import rig_settings, shell_call

DEADLINE_S = 10
POLL_S = 0.02


@dataclass
class Counts:
    """Implements ShellTelemetry."""

    started: int = 0
    exited: int = 0
    spooled: list[int] = field(default_factory=list)

    def process_started(self) -> None:
        self.started += 1

    def process_exited(self) -> None:
        self.exited += 1

    def output_spooled(self, nbytes: int) -> None:
        self.spooled.append(nbytes)


@dataclass
class Rig:
    shell: ShellRuntime
    store: StateStore
    workspace: Path
    telemetry: Counts

    def running_call(self, command: str, **params: Any) -> RunningCall:
        return shell_call(self.workspace, command, **params)

    async def run(self, command: str, **params: Any) -> dict[str, Any]:
        return await self.shell.execute(self.running_call(command, **params))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    with StateStore.open(tmp_path / "state") as opened:
        yield opened


@asynccontextmanager
async def runtime(store: StateStore, tmp_path: Path, kill_grace_s: float = 2.0) -> AsyncIterator[Rig]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    settings = rig_settings(store.path.parent, kill_grace_s=kill_grace_s)
    journal = Journal(store)
    telemetry = Counts()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            shell = ShellRuntime(settings, store, journal, nursery, telemetry=telemetry)
            yield Rig(shell, store, workspace, telemetry)
            # Everything the runtime started must end on its own: a nursery left waiting
            # would mean a command's tasks never finished.
            with trio.fail_after(DEADLINE_S):
                while shell.commands:
                    await trio.sleep(POLL_S)
            await shell.host.aclose()


async def wait_started(rig: Rig, count: int) -> None:
    with trio.fail_after(DEADLINE_S):
        while len(rig.store.recorded_processes()) < count:
            await trio.sleep(POLL_S)


async def test_a_command_runs_completes_and_is_forgotten(store, tmp_path):
    async with runtime(store, tmp_path) as rig:
        running = rig.running_call("echo out; echo err >&2; exit 3")
        result = await rig.shell.execute(running)
        assert (result["exit_code"], result["signal"], result["timed_out"]) == (3, None, False)
        assert result["stdout"]["head"] == "out\n" and result["stderr"]["head"] == "err\n"
        kinds = [kind for kind, _ in running.final_events]
        assert kinds[-1] == "exec.completed"
        assert rig.shell.known_call(running.call.call_id)
    assert rig.shell.running == 0 and rig.store.recorded_processes() == []
    assert (rig.telemetry.started, rig.telemetry.exited) == (1, 1)
    assert sum(rig.telemetry.spooled) == len("out\nerr\n") == rig.shell.spool_bytes


async def test_wait_calls_completed_returns_once_every_call_has_completed(store, tmp_path):
    finished: list[str] = []
    async with runtime(store, tmp_path) as rig:
        await rig.shell.wait_calls_completed()  # nothing running: at once

        async def run(name: str, command: str) -> None:
            await rig.run(command)
            finished.append(name)

        rig.shell.nursery.start_soon(run, "short", "sleep 0.1")
        rig.shell.nursery.start_soon(run, "long", "sleep 0.4")
        await wait_started(rig, 2)
        await rig.shell.wait_calls_completed()
        assert sorted(finished) == ["long", "short"]


async def test_stop_all_ends_a_group_ignoring_sigterm_and_refuses_new_commands(store, tmp_path):
    async with runtime(store, tmp_path, kill_grace_s=0.3) as rig:
        results: list[dict[str, Any]] = []

        async def run() -> None:
            results.append(await rig.run("trap '' TERM; sleep 30 & wait"))

        rig.shell.nursery.start_soon(run)
        await wait_started(rig, 1)
        await rig.shell.stop_all()
        await rig.shell.wait_calls_completed()
        assert results[0]["signal"] == "SIGKILL" and results[0]["timed_out"] is False
        with pytest.raises(ToolFailure) as refused:
            await rig.run("true")
        assert refused.value.code == errors.SUPERVISOR_STOPPING


async def test_signal_command_reaches_the_group_and_then_reports_not_running(store, tmp_path):
    async with runtime(store, tmp_path) as rig:
        running = rig.running_call("sleep 30")
        call_id = running.call.call_id
        results: list[dict[str, Any]] = []

        async def run() -> None:
            results.append(await rig.shell.execute(running))

        rig.shell.nursery.start_soon(run)
        await wait_started(rig, 1)
        assert rig.shell.signal_command(call_id, "SIGTERM") is None
        with trio.fail_after(DEADLINE_S):
            while not results:
                await trio.sleep(POLL_S)
        assert results[0]["signal"] == signal.SIGTERM.name
        assert rig.shell.signal_command(call_id, "SIGKILL") == errors.NOT_RUNNING
        assert rig.shell.signal_command(str(uuid.uuid4()), "SIGKILL") == errors.UNKNOWN_CALL


async def test_a_record_the_store_cannot_delete_stays_stale_and_costs_the_runtime_nothing(store, tmp_path, log_lines):
    """The record is deleted with the next commit (forget_process_soon); with the store gone
    by then, the runtime still forgets the command and carries on, and the row stays behind
    as a stale one for the next start to drop (its start time matches no live process)."""
    async with runtime(store, tmp_path) as rig:
        running = rig.running_call("sleep 0.2")
        rig.shell.nursery.start_soon(rig.shell.execute, running)
        await wait_started(rig, 1)
        store.close()  # no later commit can take the record with it
    # The runtime forgot the command anyway (the fixture waited for it) and carried on.
    assert running.call.call_id not in rig.shell.commands
    assert not [line for line in log_lines() if line["event"] == "shell.tend_crashed"]
    with sqlite3.connect(store.path) as conn:
        assert [row[0] for row in conn.execute("SELECT call_id FROM processes")] == [running.call.call_id]


async def test_a_bug_in_the_output_tasks_costs_one_command_not_the_runtime(
    store, tmp_path, log_lines, monkeypatch
):
    def broken_feed(self: StreamOutput, data: bytes) -> int:
        raise RuntimeError("bug in the output pipeline")

    async with runtime(store, tmp_path) as rig:
        with monkeypatch.context() as patched:
            patched.setattr(StreamOutput, "feed", broken_feed)
            crashed = await rig.run("echo lost")
        # The call still completed, without the output the broken pipeline lost, and the
        # runtime (its nursery, the daemon's) still runs commands.
        assert crashed["stdout"]["bytes"] == 0
        assert (await rig.run("echo fine"))["stdout"]["head"] == "fine\n"
    crashes = [line for line in log_lines() if line["event"] == "shell.tend_crashed"]
    assert len(crashes) == 1 and crashes[0]["level"] == "error"
    assert "RuntimeError: bug in the output pipeline" in crashes[0]["exception"]  # the traceback


async def test_the_host_hears_done_after_the_call_returned_its_result(store, tmp_path, monkeypatch):
    """The `done` that lets the command host forget a command is queued while the call
    returns its result (whose commit and send follow without a checkpoint; a send to the
    host wakes it, and it may take the daemon's core), and sent right after: the host then
    forgets the command and records no exit for it when the link closes."""
    from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE
    from sandbox_supervisor.daemon.runtime.spool import spool_dir

    flushed: list[list[bytes]] = []
    async with runtime(store, tmp_path) as rig:
        host = rig.shell.host
        flush = host._flush_unsent

        def recording_flush() -> None:
            flushed.append(list(host._unsent))
            flush()

        monkeypatch.setattr(host, "_flush_unsent", recording_flush)
        running = rig.running_call("true")
        result = await rig.shell.execute(running)
        assert result["exit_code"] == 0
        assert not [batch for batch in flushed if batch]  # nothing sent before the result
        assert [b'"done"' in message for message in host._unsent] == [True]
        with trio.fail_after(DEADLINE_S):
            while host._unsent:
                await trio.sleep(0)
        assert [b'"done"' in message for batch in flushed for message in batch] == [True]
    # The link is closed (the runtime's exit): a host that had not heard `done` would have
    # recorded the exit for a next daemon.
    assert not (spool_dir(store.path.parent, running.call.call_id) / EXIT_FILE).exists()


async def test_a_done_rides_with_the_next_spawn_request(store, tmp_path, monkeypatch, mock_clock):
    """A command that follows within DEFERRED_FLUSH_S carries the previous command's `done`
    to the host ahead of its own spawn request, in the same turn: the host is woken once per
    command, not twice. The delayed flush sends what no spawn took. (The mock clock stands
    still until the test moves it: the host and its commands are real.)"""
    from sandbox_supervisor.daemon.runtime.shell import DEFERRED_FLUSH_S

    sends: list[str] = []  # what reached the host's socket, in order
    async with runtime(store, tmp_path) as rig:
        host = rig.shell.host
        send_spawn = host._send_spawn
        flush = host._flush_unsent

        in_spawn = False

        def recording_flush() -> None:
            by = "with the spawn" if in_spawn else "alone"
            sends.extend(f"done {by}" for message in host._unsent if b'"done"' in message)
            flush()

        async def recording_send_spawn(message: bytes):
            nonlocal in_spawn
            in_spawn = True
            try:
                sock = await send_spawn(message)
            finally:
                in_spawn = False
            sends.append("spawn")
            return sock

        monkeypatch.setattr(host, "_flush_unsent", recording_flush)
        monkeypatch.setattr(host, "_send_spawn", recording_send_spawn)
        first = await rig.shell.execute(rig.running_call("true"))
        # The result goes out, and the daemon idles until the agent's next call.
        await trio.testing.wait_all_tasks_blocked()
        second = await rig.shell.execute(rig.running_call("true"))
        assert (first["exit_code"], second["exit_code"]) == (0, 0)
        # The first command's done went out with the second command's spawn request.
        assert sends == ["spawn", "done with the spawn", "spawn"]
        assert [b'"done"' in message for message in host._unsent] == [True]  # the second's waits
        mock_clock.jump(DEFERRED_FLUSH_S)
        for _ in range(100):  # the delayed flush runs once the clock has moved
            if not host._unsent:
                break
            await trio.testing.wait_all_tasks_blocked()
        assert sends == ["spawn", "done with the spawn", "spawn", "done alone"]
        mock_clock.autojump_threshold = 0  # the rest (the runtime's end) at its own pace


async def test_a_finished_command_costs_one_store_transaction_and_its_record_goes_with_the_next(store, tmp_path, monkeypatch, mock_clock):
    """The group's record is written with exec.started (one transaction) and deleted with the
    next write transaction (in the daemon: the call's result, or the next call's record), not
    in one of its own; with no write for DEFERRED_FLUSH_S, it goes in one of its own. (The
    mock clock stands still until the test moves it: the commands are real.)"""
    from sandbox_supervisor.daemon.runtime.shell import DEFERRED_FLUSH_S

    writes: list[str] = []
    transaction = store._transaction

    def counting(*, write: bool = True):
        if write:
            writes.append("write")
        return transaction(write=write)

    def rows() -> int:
        with sqlite3.connect(store.path) as conn:
            return conn.execute("SELECT COUNT(*) FROM processes").fetchone()[0]

    async with runtime(store, tmp_path) as rig:
        monkeypatch.setattr(store, "_transaction", counting)
        first = rig.running_call("true")
        assert (await rig.shell.execute(first))["exit_code"] == 0
        for _ in range(100):  # output ended, group gone: forgotten
            if first.call.call_id not in rig.shell.commands:
                break
            await trio.testing.wait_all_tasks_blocked()
        assert first.call.call_id not in rig.shell.commands
        assert writes == ["write"]  # exec.started and the record; the forget waits
        assert store.recorded_processes() == [] and rows() == 1
        store.append_events([("tool.result", {"call_id": first.call.call_id, "idempotency_key": None,
                                              "tool_name": "execute_shell_command", "ok": True, "result": {"n": 1}})])
        assert rows() == 0  # went with that write
        second = rig.running_call("true")
        assert (await rig.shell.execute(second))["exit_code"] == 0
        for _ in range(100):
            if second.call.call_id not in rig.shell.commands:
                break
            await trio.testing.wait_all_tasks_blocked()
        writes.clear()
        mock_clock.jump(DEFERRED_FLUSH_S)  # no write came: the deferred flush deletes it
        for _ in range(100):
            if rows() == 0:
                break
            await trio.testing.wait_all_tasks_blocked()
        assert rows() == 0 and writes == ["write"]
        mock_clock.autojump_threshold = 0  # the rest (the runtime's end) at its own pace


async def test_a_lingering_groups_record_goes_soon_after_the_group_is_gone(store, tmp_path):
    """A background descendant keeps the group after the result: once the sweep finds the
    group gone, its record is deleted within DEFERRED_FLUSH_S although no other write comes,
    while the pgid's number is still the group's."""
    async with runtime(store, tmp_path) as rig:
        running = rig.running_call("sleep 0.3 >/dev/null 2>&1 </dev/null & echo started")
        assert (await rig.shell.execute(running))["exit_code"] == 0
        with trio.fail_after(DEADLINE_S):
            while running.call.call_id in rig.shell.commands:  # the sweep forgets it
                await trio.sleep(POLL_S)
            while True:
                with sqlite3.connect(store.path) as conn:  # no other write comes meanwhile
                    if conn.execute("SELECT COUNT(*) FROM processes").fetchone()[0] == 0:
                        break
                await trio.sleep(POLL_S)
