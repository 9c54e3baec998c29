"""execute_shell_command's commands outlive their daemon (docs/protocol.md §10.2): the
command host is their parent, so a kill -9 of the daemon no longer turns a command that ran
to its end into `interrupted`. Real daemons started as users start them, real kill -9s,
real command hosts."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE
from sandbox_supervisor.daemon.runtime.processes import read_stat
from sandbox_supervisor.daemon.runtime.recovery import is_command_host
from sandbox_supervisor.daemon.runtime.spool import spool_dir
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

DEADLINE_S = 20


def stdout_events(client, call_id: str) -> str:
    return "".join(
        f["body"]["text"]
        for _, f in sorted(client.state.events.items())
        if f["kind"] == "exec.output" and f["body"]["call_id"] == call_id and f["body"]["stream"] == "stdout"
    )


def results_of(client, call_id: str) -> list[dict]:
    return [f["body"] for f in client.state.events.values() if f["kind"] == "tool.result" and f["body"]["call_id"] == call_id]


async def started_command(session, client, command: str, key: str, **params) -> tuple[str, int]:
    """Start a command and wait until it printed `before` (so it runs); its call_id and pid."""
    call_id = await session.call("execute_shell_command", {"command": command, **params}, idempotency_key=key)
    started = await session.receive_until(
        lambda f: f["kind"] == "exec.started" and f["body"]["call_id"] == call_id, timeout=DEADLINE_S
    )
    with trio.fail_after(DEADLINE_S):
        while "before" not in stdout_events(client, call_id):
            await session.receive()
    return call_id, started["body"]["pid"]


async def kill_daemon(process) -> None:
    """kill -9 of the daemon, as a crash or the OOM killer ends it."""
    process.send_signal(signal.SIGKILL)
    await process.wait()


async def start_again(process, client) -> None:
    """Start the daemon again on its state, as systemd would, and point the client at it."""
    running = await process.start()
    client.endpoint = running.tcp


async def wait_gone(pid: int) -> None:
    with trio.fail_after(DEADLINE_S):
        while (stat := read_stat(pid)) is not None and stat.state != "Z":
            await trio.sleep(0.01)


async def wait_file(path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        while not path.exists():
            await trio.sleep(0.01)


async def test_a_command_that_ends_while_no_daemon_runs_gets_its_real_result(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id, pid = await started_command(session, client, "echo before; sleep 0.5; echo after; exit 3", "ends")
            host = read_stat(pid).ppid
            assert is_command_host(host)  # the command's parent is the host, not the daemon
        await kill_daemon(process)
        # No daemon runs: the command prints on (no SIGPIPE: the host holds its pipes) and
        # ends; the host records how, then exits.
        await wait_file(spool_dir(layout.state_dir, call_id) / EXIT_FILE)
        await wait_gone(host)

        await start_again(process, client)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            result = await session.result(call_id, timeout=DEADLINE_S)
            # A retry of the key replays that one result: it does not run again.
            again = await session.call(
                "execute_shell_command", {"command": "echo before; sleep 0.5; echo after; exit 3"}, idempotency_key="ends"
            )
            replayed = await session.receive_until(
                lambda f: f["kind"] == "tool.replayed" and f["body"]["call_id"] == again, timeout=DEADLINE_S
            )
            completed = await session.exec_completed(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result
    assert result["result"]["exit_code"] == 3 and result["result"]["signal"] is None
    assert result["result"]["timed_out"] is False
    assert result["result"]["stdout"]["head"] == "before\nafter\n"
    assert completed["interrupted"] is False and completed["exit_code"] == 3
    assert replayed["body"]["original"]["body"] == result
    assert len(results_of(client, call_id)) == 1


async def test_a_command_still_running_at_restart_is_answered_when_it_ends(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    marker = layout.workspace / "go"
    command = f"echo before; while [ ! -e {marker} ]; do sleep 0.02; done; echo after; exit 4"
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id, pid = await started_command(session, client, command, "runs-on")
        await kill_daemon(process)

        await start_again(process, client)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            stat = read_stat(pid)
            assert stat is not None and stat.state != "Z"  # not killed by the restart
            # Still running: a retry of its key is told to wait for the one result.
            retry = await session.call("execute_shell_command", {"command": command}, idempotency_key="runs-on")
            await session.receive_until(
                lambda f: f["kind"] == "tool.pending" and f["body"]["call_id"] == retry, timeout=DEADLINE_S
            )
            marker.touch()
            result = await session.result(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result
    assert result["result"]["exit_code"] == 4
    assert result["result"]["stdout"]["head"] == "before\nafter\n"
    assert len(results_of(client, call_id)) == 1


async def test_a_command_that_times_out_while_no_daemon_runs_is_reported_timed_out(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id, _pid = await started_command(session, client, "echo before; sleep 30", "late", timeout_ms=1000)
        await kill_daemon(process)
        # The host applies the call's timeout itself: SIGTERM to the group.
        await wait_file(spool_dir(layout.state_dir, call_id) / EXIT_FILE)

        await start_again(process, client)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            result = await session.result(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result
    assert result["result"]["timed_out"] is True and result["result"]["signal"] == "SIGTERM"
    assert result["result"]["stdout"]["head"] == "before\n"


async def test_a_killed_command_host_reports_its_running_command_interrupted(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            call_id, pid = await started_command(session, client, "echo before; sleep 30", "orphaned")
            host = read_stat(pid).ppid
            os.kill(host, signal.SIGKILL)
            result = await session.result(call_id, timeout=DEADLINE_S)
            assert result["ok"] is False and result["error"]["code"] == "interrupted"
            assert result["error"]["stdout"]["head"] == "before\n"
            await wait_gone(pid)  # what it left running was ended
            # The next command gets a new host.
            again = await session.call("execute_shell_command", {"command": "echo fine"}, idempotency_key="next")
            assert (await session.result(again, timeout=DEADLINE_S))["result"]["stdout"]["head"] == "fine\n"
