"""execute_shell_command through a real daemon: real processes, pipes, signals, spool
(docs/protocol.md §7.4, §10.1)."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import time
import uuid

import pytest
import trio

from sandbox_supervisor.daemon.runtime.processes import group_members, read_stat
from sandbox_supervisor.daemon.runtime.shell import EXEC_STARTED_HOLD_S
from sandbox_supervisor.daemon.runtime.spool import read_state, spool_dir, stream_path
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout


async def run(session, command: str, *, key: str | None = None, **params) -> dict:
    return await session.call_and_wait(
        "execute_shell_command",
        {"command": command, **params},
        idempotency_key=key or f"k-{uuid.uuid4()}",
    )


def events_of(session, call_id: str, kind: str) -> list[dict]:
    return [
        f["body"]
        for seq, f in sorted(session.client.state.events.items())
        if f["kind"] == kind and f["body"].get("call_id") == call_id
    ]


async def run_collect(session, command: str, timeout: float = 20, **params):
    """Run and wait for the result; return (result body, call_id)."""
    call_id = await session.call(
        "execute_shell_command", {"command": command, **params}, idempotency_key=f"k-{uuid.uuid4()}"
    )
    return await session.result(call_id, timeout=timeout), call_id


async def read_all(session, call_id: str, stream: str) -> bytes:
    data = bytearray()
    while True:
        await session.send(
            "exec.read_output", {"call_id": call_id, "stream": stream, "offset": len(data), "length": 65536}
        )
        page = await session.receive_until(lambda f: f["kind"] == "exec.output_page")
        chunk = base64.b64decode(page["body"]["data"])
        data += chunk
        if page["body"]["eof"]:
            return bytes(data)
        assert chunk, "an empty page that is not eof"


# --- results --------------------------------------------------------------------------------


async def test_exit_code_and_stream_separation(session):
    result, call_id = await run_collect(session, "echo out; echo err >&2; exit 3")
    assert result["ok"] is True
    body = result["result"]
    assert body["exit_code"] == 3 and body["signal"] is None and body["timed_out"] is False
    assert body["stdout"]["head"] == "out\n" and body["stdout"]["bytes"] == 4
    assert body["stderr"]["head"] == "err\n"
    started = events_of(session, call_id, "exec.started")
    completed = events_of(session, call_id, "exec.completed")
    assert len(started) == 1 and len(completed) == 1
    assert started[0]["pgid"] == started[0]["pid"]
    assert started[0]["context"]["session_id"] == "session-1"
    assert completed[0]["interrupted"] is False
    # exec.completed precedes tool.result, and every exec event precedes both.
    kinds = [f["kind"] for s, f in sorted(session.client.state.events.items()) if f["body"].get("call_id") == call_id]
    assert kinds[0] == "exec.started" and kinds[-2:] == ["exec.completed", "tool.result"]


async def test_a_silent_commands_exec_started_is_held_then_sent_while_it_still_runs(session):
    """exec.started waits up to EXEC_STARTED_HOLD_S for the command's next event, so that a
    short command's events go out together; a command silent for longer gets its
    exec.started once the hold is over, while it runs, never only with its result."""
    call_id = await session.call("execute_shell_command", {"command": "sleep 30"}, idempotency_key=f"k-{uuid.uuid4()}")
    frame = await session.receive_until(lambda f: f["kind"] == "exec.started" and f["body"]["call_id"] == call_id)
    arrived = time.time()
    # started_at is read before the commit that starts the hold.
    assert arrived - frame["body"]["started_at"] >= EXEC_STARTED_HOLD_S
    # Received while the command runs (it would for 30 s): ended now, by the client.
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGKILL"})
    result = await session.result(call_id)
    assert result["ok"] is True and result["result"]["signal"] == "SIGKILL"


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def test_a_command_that_prints_nothing_starts_no_live_output_task(session):
    """The flusher of the live view starts with a command's first bytes: a silent command
    never pays for it, and a command that prints still has its output streamed."""
    spawns = _Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        silent, _ = await run_collect(session, "true")
        flushers_silent = sum("_flush_live" in name for name in spawns.names)
        spawns.names.clear()
        printed, call_id = await run_collect(session, "echo hi")
        flushers_printed = sum("_flush_live" in name for name in spawns.names)
    finally:
        trio.lowlevel.remove_instrument(spawns)
    assert silent["ok"] is True and silent["result"]["exit_code"] == 0
    assert flushers_silent == 0
    assert flushers_printed == 1
    assert printed["result"]["stdout"]["head"] == "hi\n"
    assert "".join(e["text"] for e in events_of(session, call_id, "exec.output")) == "hi\n"


async def test_killed_by_signal_is_still_ok(session):
    result, _ = await run_collect(session, "kill -KILL $$")
    assert result["ok"] is True
    assert result["result"]["exit_code"] is None and result["result"]["signal"] == "SIGKILL"


async def test_environment_is_isolated_from_the_daemon(tmp_path, authority, monkeypatch):
    monkeypatch.setenv("CANARY_SECRET", "canary-9f3b")
    layout = make_layout(tmp_path / "d", authority=authority)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            body = {"sessionId": client.session_id, "agent": {"cwd": str(layout.workspace), "profile": "default", "env": {"AGENT_VAR": "agent", "BOTH": "agent"}}, "repositories": []}
            await session.bootstrap(body)
            result, _ = await run_collect(session, "env", env={"CALL_VAR": "call", "BOTH": "call"})
    out = result["result"]["stdout"]["head"]
    assert "canary-9f3b" not in out and "CANARY_SECRET" not in out
    lines = set(out.splitlines())
    assert {"AGENT_VAR=agent", "CALL_VAR=call", "BOTH=call", "LANG=C.UTF-8"} <= lines


async def test_cwd_parameter_and_jail(daemon, session):
    (daemon.layout.workspace / "sub").mkdir()
    result, _ = await run_collect(session, "pwd", cwd="sub")
    assert result["result"]["stdout"]["head"].strip() == str((daemon.layout.workspace / "sub").resolve())
    escaped, _ = await run_collect(session, "pwd", cwd="..")
    assert escaped["ok"] is False and escaped["error"]["code"] == "path_outside_workspace"


@pytest.mark.parametrize("cwd", ["afile", "missing", "afile/below", "missing/below"])
async def test_a_cwd_that_is_not_a_directory_is_refused_before_anything_runs(daemon, session, cwd):
    # The jail's walk lets a missing final component, or one beneath a file, through (the
    # file tools create such paths); the shell's own check refuses them (docs/protocol.md 7.4.1).
    (daemon.layout.workspace / "afile").write_text("x")
    result, call_id = await run_collect(session, "touch ran", cwd=cwd)
    assert result["ok"] is False
    assert result["error"] == {"code": "invalid_parameters", "message": "cwd is not a directory."}
    assert events_of(session, call_id, "exec.started") == []
    assert not (daemon.layout.workspace / "ran").exists()


async def test_too_many_processes_counts_spawns_in_progress_and_frees_the_key(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"max_processes": 2})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            # Sent back to back: spawning takes a worker thread, so the limit must count
            # spawns still in progress, not only commands already running.
            for i in range(6):
                await session.call("execute_shell_command", {"command": "sleep 5"}, idempotency_key=f"s{i}")
            refused = []
            started = set()
            with trio.fail_after(10):
                while len(refused) + len(started) < 6:
                    frame = await session.receive()
                    if frame["kind"] == "exec.started":
                        started.add(frame["body"]["call_id"])
                    elif frame["kind"] == "tool.result":
                        assert frame["body"]["error"]["code"] == "too_many_processes"
                        refused.append(frame["body"])
            assert len(started) == 2 and len(refused) == 4
            for call_id in started:
                await session.send("exec.signal", {"call_id": call_id, "signal": "SIGKILL"})
            for call_id in started:
                assert (await session.result(call_id))["result"]["signal"] == "SIGKILL"
            # The refusal did nothing, so it did not use up its key: the same call runs now.
            retry = await session.call(
                "execute_shell_command", {"command": "sleep 5", "timeout_ms": 100},
                idempotency_key=refused[0]["idempotency_key"],
            )
            assert (await session.result(retry))["result"]["timed_out"] is True


async def test_allowed_commands_guard(daemon):
    client = daemon.client()
    async with client.connect(claim_overrides={"allowed_commands": ["echo", "ls"]}) as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        ok, _ = await run_collect(session, "FOO=1 echo hi | ls")
        assert ok["ok"] is True
        refused, _ = await run_collect(session, "echo hi && rm -rf x")
        assert refused["ok"] is False and refused["error"]["code"] == "forbidden"
        assert "rm" in refused["error"]["message"]
        substituted, _ = await run_collect(session, "echo $(whoami)")
        assert substituted["error"]["code"] == "forbidden"


# --- live output ----------------------------------------------------------------------------


async def test_chatty_command_is_throttled_and_offsets_are_exact(session):
    # 40 lines, one every 10 ms: far more writes than throttle windows (150 ms).
    command = "for i in $(seq 1 40); do echo line-$i; sleep 0.01; done"
    result, call_id = await run_collect(session, command)
    outputs = events_of(session, call_id, "exec.output")
    assert 1 < len(outputs) < 20
    expected = "".join(f"line-{i}\n" for i in range(1, 41))
    offset = 0
    for event in outputs:
        assert event["offset"] == offset and event["dropped_bytes"] == 0
        offset += event["bytes"]
    assert "".join(e["text"] for e in outputs) == expected
    assert result["result"]["stdout"]["bytes"] == len(expected)


async def test_overflowing_live_buffer_reports_dropped_bytes(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d",
        authority=authority,
        exec={"output_buffer_bytes": 8192, "output_max_chunk_bytes": 4096, "output_throttle_ms": 200},
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result, call_id = await run_collect(session, "head -c 300000 /dev/zero | tr '\\0' 'a'; sleep 0.3; echo tail")
            outputs = events_of(session, call_id, "exec.output")
            full = await read_all(session, call_id, "stdout")
    assert any(e["truncated"] and e["dropped_bytes"] > 0 for e in outputs)
    offset = 0
    for event in outputs:
        assert event["offset"] == offset + event["dropped_bytes"]
        offset = event["offset"] + event["bytes"]
    assert offset == 300005
    assert sum(e["bytes"] + e["dropped_bytes"] for e in outputs) == 300005
    assert full == b"a" * 300000 + b"tail\n"  # the spool has every byte
    assert result["result"]["stdout"]["bytes"] == 300005


async def test_multibyte_characters_are_never_split(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d", authority=authority, exec={"output_max_chunk_bytes": 1000, "output_throttle_ms": 20}
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            # 3-byte and 4-byte characters: 1000 is a multiple of neither.
            text = ("€" * 700 + "😀" * 500) * 3
            (layout.workspace / "u.txt").write_text(text)
            result, call_id = await run_collect(session, "cat u.txt")
    outputs = events_of(session, call_id, "exec.output")
    assert len(outputs) > 5
    assert all("\ufffd" not in e["text"] for e in outputs)
    assert "".join(e["text"] for e in outputs) == text


# --- spool ----------------------------------------------------------------------------------


async def test_read_output_returns_exact_bytes_after_reconnect_and_restart(layout):
    payload = os.urandom(5 * 1024 * 1024)
    (layout.workspace / "random.bin").write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result, call_id = await run_collect(session, "cat random.bin; echo done >&2")
            assert result["result"]["stdout"]["bytes"] == len(payload)
            assert hashlib.sha256(await read_all(session, call_id, "stdout")).hexdigest() == digest
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            assert hashlib.sha256(await read_all(session, call_id, "stdout")).hexdigest() == digest
    async with in_process_daemon(layout) as daemon:
        client.endpoint = daemon.unix
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            assert hashlib.sha256(await read_all(session, call_id, "stdout")).hexdigest() == digest
            assert await read_all(session, call_id, "stderr") == b"done\n"
            await session.send("exec.read_output", {"call_id": str(uuid.uuid4()), "stream": "stdout", "offset": 0, "length": 10})
            frame = await session.receive_until(lambda f: f["kind"] == "error")
            assert frame["body"]["code"] == "unknown_call"


# --- signals, timeouts, process groups --------------------------------------------------------


def assert_group_gone(pgid: int) -> None:
    assert group_members(pgid) == [], f"processes left in group {pgid}"


async def test_timeout_kills_grandchild_that_ignores_sigterm(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 300})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            command = "bash -c 'trap \"\" TERM; echo child-ready; sleep 30' & echo started; wait"
            result, call_id = await run_collect(session, command, timeout_ms=500)
            started = events_of(session, call_id, "exec.started")[0]
    body = result["result"]
    assert body["timed_out"] is True
    assert "started" in body["stdout"]["head"]
    with trio.fail_after(10):
        while group_members(started["pgid"]):
            await trio.sleep(0.02)
    assert_group_gone(started["pgid"])
    assert read_stat(started["pid"]) is None  # reaped: not even a zombie


async def test_sigint_reaches_the_group_and_completion_is_once(daemon, session):
    marker = daemon.layout.workspace / "got-int"
    # A background child that handles SIGINT itself (a shell's background job starts with
    # SIGINT ignored, and Python may install a handler over that): it reports only if the
    # signal went to the whole group, not just to the shell at its head.
    child = (
        f"{sys.executable} -c \"import signal, sys, time; "
        f"signal.signal(signal.SIGINT, lambda *a: (open('{marker}', 'a').write('child\\n'), sys.exit(0))); "
        "print('child-ready', flush=True); time.sleep(30)\""
    )
    command = f"trap 'echo int >> {marker}; exit 130' INT; {child} & echo ready; while true; do sleep 0.05; done"
    call_id = await session.call("execute_shell_command", {"command": command}, idempotency_key="sig")
    started = await session.receive_until(lambda f: f["kind"] == "exec.started")
    await session.receive_until(lambda f: f["kind"] == "exec.output" and "child-ready" in f["body"]["text"])
    for _ in range(5):
        await session.send("exec.signal", {"call_id": call_id, "signal": "SIGINT"})
    result = await session.result(call_id)
    assert result["ok"] is True and result["result"]["exit_code"] == 130
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGTERM"})
    frame = await session.receive_until(lambda f: f["kind"] == "error")
    assert frame["body"]["code"] == "not_running"
    await session.call_and_wait("read_file", {"path": "got-int"})  # flush the journal
    assert len(events_of(session, call_id, "exec.completed")) == 1
    assert marker.read_text().count("int") >= 1
    with trio.fail_after(10):  # the child writes its line as it exits
        while "child" not in marker.read_text():
            await trio.sleep(0.02)
    # The line comes before the child's exit (Python still has to shut down): on a loaded
    # machine the group may still hold it for a moment, so wait for it, with a deadline.
    with trio.fail_after(10):
        while group_members(started["body"]["pgid"]):
            await trio.sleep(0.02)
    assert_group_gone(started["body"]["pgid"])


async def test_background_descendant_output_after_completion(session):
    command = "echo first; (sleep 0.6; echo later) &"
    result, call_id = await run_collect(session, command)
    assert result["result"]["stdout"]["head"] == "first\n"
    later = await session.receive_until(
        lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == call_id and "later" in f["body"]["text"]
    )
    assert later["body"]["after_exit"] is True
    assert later["body"]["offset"] == len("first\n")
    before = [e for e in events_of(session, call_id, "exec.output") if not e["after_exit"]]
    assert all("later" not in e["text"] for e in before)


# --- exactly once -----------------------------------------------------------------------------


async def test_retried_shell_call_does_not_run_again(daemon, session):
    counter = daemon.layout.workspace / "count"
    params = {"command": f"echo x >> {counter}; sleep 0.3"}
    first = await session.call("execute_shell_command", params, idempotency_key="once")
    second = await session.call("execute_shell_command", params, idempotency_key="once")
    pending = await session.receive_until(lambda f: f["kind"] == "tool.pending")
    assert pending["body"]["call_id"] == second
    assert (await session.result(first))["ok"] is True
    third = await session.call("execute_shell_command", params, idempotency_key="once")
    replay = await session.receive_until(lambda f: f["kind"] == "tool.replayed")
    assert replay["body"]["call_id"] == third
    assert counter.read_text() == "x\n"


async def test_a_call_id_is_one_execution(session):
    call_id = str(uuid.uuid4())
    first = await session.call("execute_shell_command", {"command": "echo one"}, idempotency_key="first", call_id=call_id)
    assert (await session.result(first))["ok"] is True
    again = await session.call("execute_shell_command", {"command": "echo two"}, idempotency_key="second", call_id=call_id)
    frame = await session.receive_until(
        lambda f: f["kind"] == "tool.result" and f["body"]["idempotency_key"] == "second"
    )
    assert again == call_id
    assert frame["body"]["ok"] is False and frame["body"]["error"]["code"] == "invalid_parameters"
    assert await read_all(session, call_id, "stdout") == b"one\n"


async def test_read_output_of_a_running_command(session):
    call_id = await session.call(
        "execute_shell_command", {"command": "printf 'partial'; sleep 30"}, idempotency_key="running"
    )
    await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == call_id)
    await session.send("exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": 2, "length": 100})
    page = await session.receive_until(lambda f: f["kind"] == "exec.output_page")
    assert base64.b64decode(page["body"]["data"]) == b"rtial"
    assert page["body"]["eof"] is False  # still running: more may come
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGKILL"})
    assert (await session.result(call_id))["result"]["signal"] == "SIGKILL"


async def test_spools_past_the_disk_cap_lose_their_oldest_finished_calls(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"spool_total_max_bytes": 150_000})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            # A long-running command's spool is never pruned, however old.
            long_id = await session.call(
                "execute_shell_command", {"command": "head -c 60000 /dev/zero; sleep 30"}, idempotency_key="long"
            )
            await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == long_id)
            ids = []
            for i in range(4):
                result, call_id = await run_collect(session, "head -c 60000 /dev/zero")
                assert result["ok"] is True
                ids.append(call_id)
            # The last command's output tasks finish, then the prune runs: wait for it
            # (bounded) rather than sleep a guess that a loaded machine can overrun.
            with trio.move_on_after(10):
                while any(spool_dir(layout.state_dir, old).exists() for old in ids[:2]):
                    await trio.sleep(0.02)
            for old in ids[:2]:
                await session.send("exec.read_output", {"call_id": old, "stream": "stdout", "offset": 0, "length": 10})
                frame = await session.receive_until(lambda f: f["kind"] in ("error", "exec.output_page"))
                assert frame["kind"] == "error" and frame["body"]["code"] == "unknown_call"
            assert len(await read_all(session, ids[-1], "stdout")) == 60000
            await session.send("exec.read_output", {"call_id": long_id, "stream": "stdout", "offset": 0, "length": 65536})
            page = await session.receive_until(lambda f: f["kind"] == "exec.output_page")
            assert len(base64.b64decode(page["body"]["data"])) == 60000
            await session.send("exec.signal", {"call_id": long_id, "signal": "SIGKILL"})
            await session.result(long_id)
        assert daemon.supervisor.shell.spool_bytes <= 150_000 + 60000


# Bursts of short commands beside a long one, together far past a small cap that what runs
# at once fits in (else new output would be dropped, test_spool_full_*): every command that
# finishes asks for a prune while others start and write.
BURSTS, BURST_SIZE = 4, 12
LINE = "x" * 100
PRUNED_CAP = 5000
LONG_BYTES = 500


async def test_pruning_never_takes_a_running_commands_spool(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d", authority=authority, exec={"spool_total_max_bytes": PRUNED_CAP, "max_processes": 2 * BURST_SIZE}
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            long_id = await session.call(
                "execute_shell_command", {"command": f"head -c {LONG_BYTES} /dev/zero; sleep 30"}, idempotency_key="long"
            )
            await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == long_id)
            ids = []
            for _ in range(BURSTS):
                burst = [
                    await session.call(
                        "execute_shell_command",
                        {"command": f"echo {LINE}; sleep 0.0{i % 10}; echo {LINE}"},
                        idempotency_key=f"k-{uuid.uuid4()}",
                    )
                    for i in range(BURST_SIZE)
                ]
                for call_id in burst:
                    await session.result(call_id, timeout=20)
                ids += burst
            # Each command's spool was there for all of its run: its summary has every byte.
            for call_id in ids:
                stdout = (await session.result(call_id))["result"]["stdout"]
                assert (stdout["bytes"], stdout["truncated"]) == (2 * (len(LINE) + 1), False), call_id
            # The long command, still running and older than every pruned one, keeps its spool.
            await session.send("exec.read_output", {"call_id": long_id, "stream": "stdout", "offset": 0, "length": 65536})
            page = await session.receive_until(lambda f: f["kind"] == "exec.output_page")
            assert len(base64.b64decode(page["body"]["data"])) == LONG_BYTES
            # Finished spools did go, oldest first, down to what still runs.
            assert not spool_dir(layout.state_dir, ids[0]).exists()
            await session.send("exec.signal", {"call_id": long_id, "signal": "SIGKILL"})
            await session.result(long_id)


# A cap well under what one command prints, and above one pipe read (64 KiB), so that the
# first reads fit and a later one is cut at the cap exactly.
FULL_CAP = 100_000
FLOOD_BYTES = 300_000
DEADLINE_S = 20


def wait_for(path) -> str:
    """A shell loop that waits (bounded by the test's deadline) for `path` to exist."""
    return f"while [ ! -e {path} ]; do sleep 0.02; done"


async def test_spool_full_drops_new_output_of_running_commands(tmp_path, authority):
    """When the spools a prune may not take (running commands') alone reach
    exec.spool_total_max_bytes, new output is not written any more: dropped and counted as past
    a stream's own cap, while the live events still carry it. Once a command ends and its
    spool is pruned, there is room again for streams that have dropped nothing."""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"spool_total_max_bytes": FULL_CAP})
    flooded, later = layout.workspace / "flooded", layout.workspace / "later"
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            quiet = await session.call(
                "execute_shell_command",
                {"command": f"printf early; {wait_for(later)}; printf later"},
                idempotency_key="quiet",
            )
            await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == quiet)
            flood = await session.call(
                "execute_shell_command",
                {"command": f"head -c {FLOOD_BYTES} /dev/zero; {wait_for(flooded)}"},
                idempotency_key="flood",
            )
            # Every byte reaches the live events (offsets count what the live buffer dropped).
            await session.receive_until(
                lambda f: f["kind"] == "exec.output"
                and f["body"]["call_id"] == flood
                and f["body"]["offset"] + f["body"]["bytes"] == FLOOD_BYTES,
                timeout=DEADLINE_S,
            )
            # While it runs, its spool stopped growing at the cap: with the quiet one's bytes
            # the spools hold exactly the cap, and the stream says it is truncated.
            flood_stdout = stream_path(layout.state_dir, flood, "stdout")
            quiet_stdout = stream_path(layout.state_dir, quiet, "stdout")
            assert flood_stdout.stat().st_size + quiet_stdout.stat().st_size == FULL_CAP
            state = read_state(flood_stdout)
            assert state is not None and state.truncated and not state.ended
            assert daemon.supervisor.shell.spool_bytes == FULL_CAP
            flooded.touch()
            result = await session.result(flood, timeout=DEADLINE_S)
            stdout = result["result"]["stdout"]
            assert (stdout["bytes"], stdout["truncated"]) == (FLOOD_BYTES, True)
            # Its end makes its spool prunable: the prune gives the quiet one room again.
            with trio.fail_after(DEADLINE_S):
                while spool_dir(layout.state_dir, flood).exists():
                    await trio.sleep(0.02)
            later.touch()
            result = await session.result(quiet, timeout=DEADLINE_S)
            stdout = result["result"]["stdout"]
            assert (stdout["head"], stdout["truncated"]) == ("earlylater", False)
            assert await read_all(session, quiet, "stdout") == b"earlylater"


async def test_a_lingering_group_is_forgotten_once_its_last_process_exits(daemon, session):
    """A background process that closed its pipes outlives the call. The daemon keeps its
    group (a stop must still end it) only until the group is empty: after that the number
    may go to an unrelated process, which a stop or a restart must never signal."""
    result, call_id = await run_collect(session, "sleep 1.5 >/dev/null 2>&1 & echo started")
    assert result["ok"] is True and "started" in result["result"]["stdout"]["head"]
    shell = daemon.supervisor.shell
    store = daemon.supervisor.store
    pgid = events_of(session, call_id, "exec.started")[0]["pgid"]
    assert call_id in shell.commands  # the sleep still runs in the group
    assert call_id in [row[0] for row in store.recorded_processes()]
    with trio.fail_after(15):
        while call_id in shell.commands:
            await trio.sleep(0.05)
    assert not group_members(pgid)
    assert call_id not in [row[0] for row in store.recorded_processes()]
