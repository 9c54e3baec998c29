"""Shell commands across a daemon crash and under a client that stops reading, with the
daemon as a real subprocess (docs/protocol.md §9, §10.2)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import trio

from sandbox_supervisor.daemon.runtime.processes import group_members, kill_leftover_group, read_stat, start_ticks
from sandbox_supervisor.daemon.runtime.spool import stream_path
from sandbox_supervisor.testing.daemon import make_layout, running_daemon


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not found")


async def test_kill_9_of_the_daemon_and_its_command_host_reports_commands_interrupted_once(tmp_path, authority):
    """With the command host gone too, nobody recorded how the commands ended: they are killed
    at the next start and reported interrupted, once (tests/test_command_host.py has the
    case where the host outlives the daemon: real results)."""
    layout = make_layout(tmp_path / "d", authority=authority)
    # Stopped and started again mid-body (the same process object): leaving stops the current run.
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        cwd = str(layout.workspace)
        call_ids, pgids = [], []
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            for i in range(3):
                call_ids.append(
                    await session.call(
                        "execute_shell_command",
                        {"command": f"echo started-{i}; sleep 0.05 & sleep 60"},
                        idempotency_key=f"long-{i}",
                    )
                )
            hosts = set()
            for _ in range(3):
                frame = await session.receive_until(lambda f: f["kind"] == "exec.started")
                pgids.append(frame["body"]["pgid"])
                hosts.add(read_stat(frame["body"]["pid"]).ppid)
            # Wait until each command's first line is in the spool (and sent live).
            with trio.fail_after(5):
                while sum(1 for f in client.state.events.values() if f["kind"] == "exec.output") < 3:
                    await session.receive()
        process.send_signal(signal.SIGKILL)
        await process.wait()
        assert len(hosts) == 1
        os.kill(hosts.pop(), signal.SIGKILL)
        # The orphaned groups are still there until the next start cleans them up.
        assert all(group_members(pgid) for pgid in pgids)

        running = await process.start()
        client.endpoint = running.tcp
        async with client.connect() as session:
            state = await session.bootstrap(cwd=cwd)
            last = state["body"]["localEventMax"]
            while max(client.state.events) < last:
                await session.receive()
            # A retry with the same key is answered from the record: nothing runs again.
            retry = await session.call(
                "execute_shell_command",
                {"command": "echo started-0; sleep 0.05 & sleep 60"},
                idempotency_key="long-0",
            )
            replayed = await session.receive_until(lambda f: f["kind"] == "tool.replayed")
            assert replayed["body"]["call_id"] == retry
    assert process.returncode == 0

    for pgid in pgids:
        assert group_members(pgid) == []
    for i, call_id in enumerate(call_ids):
        completed = [f["body"] for f in client.state.events.values() if f["kind"] == "exec.completed" and f["body"]["call_id"] == call_id]
        results = [f["body"] for f in client.state.events.values() if f["kind"] == "tool.result" and f["body"]["call_id"] == call_id]
        assert len(completed) == 1 and completed[0]["interrupted"] is True
        assert completed[0]["stdout"]["head"] == f"started-{i}\n"
        assert len(results) == 1
        assert results[0]["ok"] is False and results[0]["error"]["code"] == "interrupted"
        assert results[0]["error"]["stdout"]["head"] == f"started-{i}\n"


async def test_sigterm_ends_running_commands_and_journals_their_completion(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 300})
    # Stopped and started again mid-body (the same process object): leaving stops the current run.
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            call_id = await session.call(
                "execute_shell_command", {"command": "trap '' TERM; echo ready; sleep 60"}, idempotency_key="stubborn"
            )
            started = await session.receive_until(lambda f: f["kind"] == "exec.started")
            # Signal only once the trap is in place (before it, SIGTERM would simply work).
            await session.receive_until(lambda f: f["kind"] == "exec.output" and "ready" in f["body"]["text"])
            process.send_signal(signal.SIGTERM)
            reason = await session.closed_reason(timeout=10)
            assert reason.code == 1001
        assert await process.wait(timeout=10) == 0
        assert group_members(started["body"]["pgid"]) == []
        running = await process.start()
        client.endpoint = running.tcp
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result = await session.result(call_id)
    assert process.returncode == 0
    assert result["ok"] is True and result["result"]["signal"] == "SIGKILL"
    completed = [f for f in client.state.events.values() if f["kind"] == "exec.completed"]
    assert len(completed) == 1 and completed[0]["body"]["interrupted"] is False


async def test_slow_client_and_a_gigabyte_of_output(tmp_path, authority):
    """A client that stops reading while a command prints 1 GiB: the command finishes, the
    daemon's memory stays bounded, and the spool has every byte."""
    gib = 1024 * 1024 * 1024
    layout = make_layout(tmp_path / "d", authority=authority, exec={"spool_max_bytes": 2 * gib, "spool_total_max_bytes": 4 * gib})
    async with running_daemon(layout) as process:
        running = process.running
        pid = process.proc.pid
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            baseline = rss_kib(pid)
            call_id = await session.call(
                "execute_shell_command",
                {"command": "head -c 1073741824 /dev/zero", "timeout_ms": 60000},
                idempotency_key="gigabyte",
            )
            # Read nothing; watch the daemon until the command's completion is journaled.
            with trio.fail_after(90):
                while True:
                    await trio.sleep(0.25)
                    log = process.log_text()
                    if '"tool.finished"' in log and call_id in log:
                        break
            peak = rss_kib(pid, "VmHWM")
            result = await session.result(call_id, timeout=30)
        spool = stream_path(layout.state_dir, call_id, "stdout")
        size = spool.stat().st_size
    assert process.returncode == 0
    growth_mib = (peak - baseline) / 1024
    print(f"daemon RSS baseline {baseline / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, growth {growth_mib:.1f} MiB")
    assert result["ok"] is True and result["result"]["exit_code"] == 0
    assert result["result"]["stdout"]["bytes"] == gib and result["result"]["stdout"]["truncated"] is False
    assert size == gib
    assert growth_mib < 64
    with open(spool, "rb") as handle:
        handle.seek(gib - 4096)
        assert handle.read() == b"\0" * 4096


async def test_streams_held_by_descendants_end_after_a_crash(tmp_path, authority):
    """A completed call whose background descendant still held its pipes when the daemon
    died: the next start kills the descendant and ends the streams, so paging reaches eof."""
    import base64

    layout = make_layout(tmp_path / "d", authority=authority)
    # Stopped and started again mid-body (the same process object): leaving stops the current run.
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result = await session.call_and_wait(
                "execute_shell_command", {"command": "echo hi; (sleep 60; echo late) &"}, idempotency_key="bg"
            )
            call_id = next(f["body"]["call_id"] for f in client.state.events.values() if f["kind"] == "exec.started")
            pgid = next(f["body"]["pgid"] for f in client.state.events.values() if f["kind"] == "exec.started")
        assert result["ok"] is True and group_members(pgid)
        client.endpoint = (await process.kill_and_start()).tcp
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.send("exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": 0, "length": 100})
            page = await session.receive_until(lambda f: f["kind"] == "exec.output_page")
    assert process.returncode == 0
    assert base64.b64decode(page["body"]["data"]) == b"hi\n"
    assert page["body"]["eof"] is True
    assert group_members(pgid) == []


def _spawn_group(script: str) -> subprocess.Popen:
    return subprocess.Popen(["/bin/bash", "-c", script], start_new_session=True, stdout=subprocess.DEVNULL)


def test_a_leftover_group_is_killed_descendants_included():
    shell = _spawn_group("sleep 60 & sleep 60 & (sleep 60 & wait) & wait")
    try:
        deadline = time.monotonic() + 10
        while len(group_members(shell.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        killed = kill_leftover_group(shell.pid, shell.pid, start_ticks(shell.pid))
        shell.wait(timeout=10)
        assert killed >= 5
        deadline = time.monotonic() + 10
        while group_members(shell.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert group_members(shell.pid) == []
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def test_a_group_whose_pid_now_belongs_to_another_process_is_left_alone():
    """The recorded start time differs from the process that now holds the pid: the kernel
    reused the number, so nothing in that group can be ours — not the leader, not its
    children."""
    other = _spawn_group("sleep 60 & wait")
    try:
        deadline = time.monotonic() + 10
        while len(group_members(other.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        recorded = start_ticks(other.pid) - 1  # "our" shell started earlier: another process
        assert kill_leftover_group(other.pid, other.pid, recorded) == 0
        assert len(group_members(other.pid)) == 2
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
