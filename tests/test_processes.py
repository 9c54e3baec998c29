"""Processes kept by a holder (docs/protocol.md §7.7): start_process, stdin with offsets,
terminals, exec.list, and what a daemon restart leaves of them (nothing lost, nothing twice).
Real daemons, real holders, real processes and PTYs."""

from __future__ import annotations

import base64
import os
import signal

import pytest
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.testing.client import ExecRefused
from sandbox_supervisor.daemon.exits import EXIT_RESTART

DEADLINE_S = 20


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def output_of(client, call_id: str, stream: str = "stdout") -> str:
    """The live exec.output text of one process, in seq order."""
    return "".join(
        f["body"]["text"]
        for _, f in sorted(client.state.events.items())
        if f["kind"] == "exec.output" and f["body"]["call_id"] == call_id and f["body"]["stream"] == stream
    )


async def wait_output(session, client, call_id: str, needle: str, stream: str = "stdout") -> None:
    with trio.fail_after(DEADLINE_S):
        while needle not in output_of(client, call_id, stream):
            await session.receive()


async def completed(session, client, call_id: str) -> dict:
    return await session.exec_completed(call_id, timeout=DEADLINE_S)


async def start(session, command: str, key: str, **params) -> tuple[str, dict]:
    call_id = await session.call("start_process", {"command": command, **params}, idempotency_key=key)
    result = await session.result(call_id)
    assert result["ok"], result
    return call_id, result["result"]


async def stdin(session, call_id: str, offset: int, text: str) -> dict:
    return await session.write_stdin(call_id, offset, text.encode())


async def test_a_prompt_is_answered_through_stdin(session, daemon):
    client = session.client
    call_id, started = await start(session, 'read -r name; echo "hello $name"', "p-1")
    assert started["pid"] > 0 and started["pty"] is False
    ack = await stdin(session, call_id, 0, "world\n")
    assert ack == {"call_id": call_id, "offset": 0, "next_offset": 6, "closed": False}
    body = await completed(session, client, call_id)
    assert body["exit_code"] == 0 and body["interrupted"] is False
    assert output_of(client, call_id) == "hello world\n"
    assert body["stdout"]["head"] == "hello world\n"


async def test_stdin_offsets_never_write_twice_and_refuse_gaps(session, daemon):
    client = session.client
    call_id, _ = await start(session, "cat", "p-cat")
    assert (await stdin(session, call_id, 0, "abc\n"))["next_offset"] == 4
    # A retry of bytes already written (after a lost ack, say) is acknowledged, not written.
    assert (await stdin(session, call_id, 0, "abc\n"))["next_offset"] == 4
    # A retry that overlaps and goes further writes only what is new.
    assert (await stdin(session, call_id, 0, "abc\ndef\n"))["next_offset"] == 8
    # A gap is refused: nothing written, the expected offset returned.
    gap = await stdin(session, call_id, 20, "zzz\n")
    assert gap["next_offset"] == 8 and gap["closed"] is False
    closed = await session.close_stdin(call_id, 8)
    assert closed["closed"] is True and closed["next_offset"] == 8
    body = await completed(session, client, call_id)
    assert body["exit_code"] == 0
    assert output_of(client, call_id) == "abc\ndef\n"


async def test_a_terminal_process_sees_a_terminal_follows_resizes_and_takes_ctrl_c(session, daemon):
    client = session.client
    pty = {"rows": 24, "cols": 80}
    # `echo SLEEPING`, a builtin, after the second stty: bash ignores a SIGINT that arrives
    # while it waits for a child that then exits normally (wait-and-cooperative-exit), so a
    # Ctrl-C sent as soon as stty's output shows could be swallowed while stty is being
    # reaped, and the sleep would run its 30 s. Once the builtin's line shows, stty is reaped.
    call_id, started = await start(
        session, "test -t 0 && echo TTY; stty size; read -r _; stty size; echo SLEEPING; sleep 30", "p-pty", pty=pty
    )
    assert started["pty"] is True
    await wait_output(session, client, call_id, "24 80")
    assert "TTY" in output_of(client, call_id)
    await session.send("exec.resize", {"call_id": call_id, "rows": 40, "cols": 100})
    await stdin(session, call_id, 0, "\n")
    await wait_output(session, client, call_id, "SLEEPING")
    assert "40 100" in output_of(client, call_id)
    # Ctrl-C through the line discipline: SIGINT to the foreground group (the sleep and its shell).
    await stdin(session, call_id, 1, "\x03")
    body = await completed(session, client, call_id)
    assert body["signal"] == "SIGINT" or body["exit_code"] == 130, body
    assert body["timed_out"] is False


async def test_resize_without_a_terminal_and_stdin_of_a_finished_process_are_typed_errors(session, daemon):
    client = session.client
    call_id, _ = await start(session, "cat", "p-plain")
    await session.send("exec.resize", {"call_id": call_id, "rows": 10, "cols": 10})
    error = await session.receive_until(lambda f: f["kind"] == "error")
    assert error["body"]["code"] == errors.NOT_A_TERMINAL and error["body"]["call_id"] == call_id
    await session.send("exec.close_stdin", {"call_id": call_id, "offset": 0})
    await completed(session, client, call_id)
    with pytest.raises(ExecRefused) as refused:
        await session.write_stdin(call_id, 0, b"late")
    assert refused.value.code == errors.NOT_RUNNING


async def test_exec_list_shows_running_and_ended_processes(session, daemon):
    client = session.client
    running, _ = await start(session, "sleep 30", "p-run")
    ended, _ = await start(session, "exit 3", "p-end")
    assert (await completed(session, client, ended))["exit_code"] == 3
    by_id = {p["call_id"]: p for p in await session.list_processes()}
    assert by_id[running]["running"] is True and by_id[running]["exit"] is None
    assert by_id[ended]["running"] is False and by_id[ended]["exit"]["exit_code"] == 3
    assert by_id[running]["command"] == "sleep 30"
    await session.send("exec.signal", {"call_id": running, "signal": "SIGKILL"})
    assert (await completed(session, client, running))["signal"] == "SIGKILL"


async def test_start_process_is_exactly_once_by_key(session, daemon):
    client = session.client
    command = "echo once >> ../once.log; echo ran; sleep 30"
    call_id, first = await start(session, command, "p-once")
    retry = await session.call("start_process", {"command": command}, idempotency_key="p-once")
    frame = await session.receive_until(lambda f: f["kind"] == "tool.replayed" and f["body"]["call_id"] == retry)
    assert frame["body"]["original"]["body"]["result"]["pid"] == first["pid"]
    # The answer comes once the process is spawned, not once its shell has run the echo: a
    # SIGTERM sent at once can end the shell before it writes (seen on a slow machine).
    await wait_output(session, client, call_id, "ran\n")
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGTERM"})
    await completed(session, client, call_id)
    assert (daemon.layout.workspace.parent / "once.log").read_text() == "once\n"


# -- across daemon restarts (the daemon as a real subprocess) ------------------------------

# The counter is killed (and waited for) before the answer is printed: killed after it, it
# could print one more number behind "got …" now and then, and the spool would not end there.
COUNTER = (
    '(i=0; while :; do echo "$i"; i=$((i+1)); sleep 0.01; done) & '
    'read -r line; kill $!; wait $! 2>/dev/null; echo "got $line"; exit 7'
)


def events_of(client, call_id: str, kind: str) -> list[dict]:
    return [f["body"] for _, f in sorted(client.state.events.items()) if f["kind"] == kind and f["body"]["call_id"] == call_id]


def assert_live_output_is_the_spool_once(client, call_id: str, spool_text: str) -> None:
    """Every exec.output continues where the previous one ended (no byte twice, none skipped),
    and together they are the spool."""
    chunks = events_of(client, call_id, "exec.output")
    offset = 0
    for chunk in chunks:
        assert chunk["offset"] == offset, (chunk["offset"], offset)
        assert chunk["dropped_bytes"] == 0
        offset += chunk["bytes"]
    assert "".join(c["text"] for c in chunks) == spool_text


async def _restart_keeps_the_counter(tmp_path, authority, how: str) -> None:
    from sandbox_supervisor.daemon.runtime.processes import read_stat
    from sandbox_supervisor.daemon.runtime.spool import stream_path
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id, started = await start(session, COUNTER, "counter")
            await wait_output(session, client, call_id, "5\n")
        if how == "kill":
            process.send_signal(signal.SIGKILL)
            await process.wait()
        else:
            process.send_signal(signal.SIGUSR2)
            assert await process.wait() == EXIT_RESTART
        stat = read_stat(started["pid"])
        assert stat is not None and stat.state != "Z"  # the process outlived its daemon
        spooled_before = stream_path(layout.state_dir, call_id, "stdout").stat().st_size

        running = await process.start()
        client.endpoint = running.tcp
        async with client.connect() as session:
            state = await session.bootstrap(cwd=cwd)
            with trio.fail_after(DEADLINE_S):
                while max(client.state.events) < state["body"]["localEventMax"]:
                    await session.receive()
            # The adopted process keeps printing, live, after where the spool was.
            with trio.fail_after(DEADLINE_S):
                while len(output_of(client, call_id)) <= spooled_before + 20:
                    await session.receive()
            # stdin works again: the answer ends it, with its real status, once.
            ack = await stdin(session, call_id, 0, "again\n")
            assert ack["next_offset"] == 6
            body = await completed(session, client, call_id)
            assert body["exit_code"] == 7 and body["interrupted"] is False
            await wait_output(session, client, call_id, "got again\n")
            # Drain what is left before comparing (after_exit output is none here: the
            # counter was killed before the exit).
            with trio.move_on_after(0.5):
                while True:
                    await session.receive()
    assert process.returncode == 0
    spool_text = stream_path(layout.state_dir, call_id, "stdout").read_text()
    counted = [line for line in spool_text.splitlines() if line.isdigit()]
    assert counted == [str(i) for i in range(len(counted))]  # every value once, in order
    assert spool_text.endswith("got again\n")
    assert len(events_of(client, call_id, "exec.completed")) == 1
    assert_live_output_is_the_spool_once(client, call_id, spool_text)


async def test_a_process_outlives_a_kill_9_of_its_daemon(tmp_path, authority):
    await _restart_keeps_the_counter(tmp_path, authority, "kill")


async def test_a_restart_that_keeps_processes_hands_them_to_the_next_daemon(tmp_path, authority):
    await _restart_keeps_the_counter(tmp_path, authority, "usr2")


async def test_a_process_that_ends_while_no_daemon_runs_is_reported_with_its_real_status(tmp_path, authority):
    from sandbox_supervisor.daemon.runtime.processes import read_stat
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id, started = await start(session, "read -r _; echo bye; exit 42", "ends-alone")
        process.send_signal(signal.SIGKILL)
        await process.wait()
        # No daemon runs: the process ends by an outside signal; its holder records how.
        os.kill(started["pid"], signal.SIGTERM)
        with trio.fail_after(DEADLINE_S):
            while (stat := read_stat(started["pid"])) is not None and stat.state != "Z":
                await trio.sleep(0.01)
        running = await process.start()
        client.endpoint = running.tcp
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            body = await completed(session, client, call_id)
    assert body["signal"] == "SIGTERM" and body["interrupted"] is False
    assert len(events_of(client, call_id, "exec.completed")) == 1


async def test_a_stop_ends_held_processes_and_reports_them(tmp_path, authority):
    from sandbox_supervisor.daemon.runtime.processes import read_stat
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            call_id, started = await start(session, "sleep 300", "stopped")
        assert await process.stop() == 0
        assert read_stat(started["pid"]) is None or read_stat(started["pid"]).state == "Z"
        running = await process.start()
        client.endpoint = running.tcp
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            body = await completed(session, client, call_id)
    assert body["signal"] == "SIGTERM" and body["interrupted"] is False


async def test_a_process_runs_past_the_commands_60_s_cap(session, daemon):
    """execute_shell_command stops at 60 s (the seed's cap); a held process without a timeout
    keeps running. The one slow test of this file: it waits for 61 s of real time."""
    client = session.client
    call_id, _ = await start(session, "sleep 61; echo still-here", "p-long")
    with trio.fail_after(61 + DEADLINE_S):
        while not events_of(client, call_id, "exec.completed"):
            await session.receive(timeout=61 + DEADLINE_S)
    body = events_of(client, call_id, "exec.completed")[0]
    assert body["exit_code"] == 0 and body["timed_out"] is False and body["duration_ms"] >= 61_000
    assert output_of(client, call_id) == "still-here\n"


async def test_a_holder_killed_while_its_process_is_silent_is_reported_at_once(session, daemon):
    """Nothing to read and no event to come: the link's end alone must wake the daemon, which
    ends what is left of the process and reports it interrupted."""
    from sandbox_supervisor.daemon.runtime.holder_protocol import read_holder
    from sandbox_supervisor.daemon.runtime.processes import read_stat
    from sandbox_supervisor.daemon.runtime.spool import spool_dir

    client = session.client
    call_id, started = await start(session, "sleep 300", "p-orphan")
    holder = read_holder(spool_dir(daemon.layout.state_dir, call_id))
    assert holder is not None
    os.kill(holder.holder_pid, signal.SIGKILL)
    body = await completed(session, client, call_id)
    assert body["interrupted"] is True and body["exit_code"] is None
    stat = read_stat(started["pid"])
    assert stat is None or stat.state == "Z"  # its group was killed with the report


async def test_output_after_the_exit_still_arrives_live_as_after_exit(session, daemon, log_lines):
    """A background child keeps writing after the process exited: its output follows the
    process's exec.completed as after_exit events, and following the process does not fail."""
    client = session.client
    call_id, _ = await start(session, "(sleep 0.5; echo late) & echo early; exit 0", "p-late")
    body = await completed(session, client, call_id)
    assert body["exit_code"] == 0
    await wait_output(session, client, call_id, "late\n")
    late = [e for e in events_of(client, call_id, "exec.output") if "late" in e["text"]]
    assert late and all(e["after_exit"] for e in late)
    seqs = {f["body"].get("text"): seq for seq, f in client.state.events.items() if f["body"].get("call_id") == call_id}
    completed_seq = next(seq for seq, f in client.state.events.items() if f["kind"] == "exec.completed" and f["body"]["call_id"] == call_id)
    assert seqs["late\n"] > completed_seq
    assert not [line for line in log_lines() if line["event"] == "process.tend_crashed"]
