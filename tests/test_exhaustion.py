"""Resource exhaustion is an answer or a retry, never a crash (docs/operations.md, "Faults and
what the daemon does"; docs/protocol.md §7.6, §8).

The daemon runs as a real subprocess whose descriptor limit the test lowers from outside
(prlimit(2) on its pid, as root may): every descriptor it already holds keeps working, and
each new one fails with EMFILE, at the moment the test chooses. A full disk is a small tmpfs
mounted over the workspace.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

from sandbox_supervisor.daemon.edge import server
from sandbox_supervisor.daemon.runtime.failures import os_failure
from sandbox_supervisor.daemon.runtime.processes import group_members
from sandbox_supervisor.daemon.runtime.shell import start_failure
from sandbox_supervisor.protocol import errors
from sandbox_supervisor.testing.client import ControlSession
from sandbox_supervisor.testing.daemon import DaemonProcess, in_process_daemon, make_layout, running_daemon

# A disk this small fills with one file; tmpfs counts whole pages.
TMPFS_BYTES = 64 * 1024
CREATE_G = "--- /dev/null\n+++ b/g.txt\n@@ -0,0 +1 @@\n+x\n"
ZERO_SHA = "0" * 40


@contextmanager
def descriptors_exhausted(pid: int, spare: int = 0) -> Iterator[None]:
    """Lower `pid`'s soft descriptor limit so that only `spare` more descriptors can be
    opened (new descriptors take the lowest free number, and fail with EMFILE at or above
    the limit); the old limit is back on leaving."""
    used = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    free = (number for number in itertools.count() if number not in used)
    limit = next(itertools.islice(free, spare, None))
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        try:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        except ProcessLookupError:
            pass  # it has exited (a stop under the limit)


def assert_json_log(process: DaemonProcess) -> list[dict[str, Any]]:
    """Every line the daemon wrote is one JSON object (no traceback, no stray text)."""
    lines = process.log_text().splitlines()
    for line in lines:
        assert isinstance(json.loads(line), dict), line
    return [json.loads(line) for line in lines]


async def answer_kind(session: ControlSession, call_id: str) -> tuple[str, dict[str, Any]]:
    """Whether a call ran (tool.result) or was answered from its key's record
    (tool.replayed), with the result's body."""
    frame = await session.receive_until(
        lambda f: f["kind"] in ("tool.result", "tool.replayed") and f["body"]["call_id"] == call_id
    )
    body = frame["body"] if frame["kind"] == "tool.result" else frame["body"]["original"]["body"]
    return frame["kind"], body


async def test_commands_that_end_while_descriptors_run_out_are_answered_and_the_daemon_lives(tmp_path, authority):
    """The crash of the issue: a command ending (and one timing out) while the daemon can
    open nothing made its tending task read /proc, fail with EMFILE and end the daemon."""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 300})
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            ends = await session.call(
                "execute_shell_command", {"command": "sleep 0.3; echo done", "timeout_ms": 10_000},
                idempotency_key="ends",
            )
            stuck = await session.call(
                "execute_shell_command", {"command": "sleep 30", "timeout_ms": 300}, idempotency_key="stuck"
            )
            for _ in range(2):
                await session.receive_until(lambda f: f["kind"] == "exec.started")
            with descriptors_exhausted(process.proc.pid):
                ended = await session.result(ends)
                timed_out = await session.result(stuck)
                # A round trip after the results: the tending tasks, which met the
                # shortage when the commands' pipes closed, are done, and the daemon runs.
                await session.list_processes()
                assert process.returncode is None
            assert ended["ok"] is True and ended["result"]["exit_code"] == 0
            assert ended["result"]["stdout"]["head"] == "done\n"
            # Not `internal`: the timeout ends the command as it would with descriptors.
            assert timed_out["ok"] is True and timed_out["result"]["timed_out"] is True
            # Recovered: a command runs once the limit is back.
            again = await session.call("execute_shell_command", {"command": "echo again"}, idempotency_key="again")
            again_result = await session.result(again)
            assert again_result["ok"] is True, again_result["error"]
        assert await process.stop() == 0
    events = assert_json_log(process)
    assert "supervisor.stopped" in [e["event"] for e in events]
    assert "tool.crashed" not in [e["event"] for e in events]


async def test_tools_answer_resource_exhausted_when_descriptors_run_out_and_a_retry_runs(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    (layout.workspace / "f.txt").write_text("hello\n")
    calls = {
        "read_file": {"path": "f.txt"},
        "apply_file_patch": {"path": "g.txt", "base_sha": ZERO_SHA, "diff": CREATE_G},
        "execute_shell_command": {"command": "echo ran"},
    }
    async with running_daemon(layout) as process:
        pid = process.proc.pid
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            refused = {}
            with descriptors_exhausted(pid):
                for tool, params in calls.items():
                    call_id = await session.call(tool, params, idempotency_key=f"key-{tool}")
                    refused[tool] = await session.result(call_id)
            # One descriptor to spare: the cwd resolves, the spawn (spool files, pipes) fails.
            with descriptors_exhausted(pid, spare=1):
                call_id = await session.call("execute_shell_command", {"command": "echo ran"}, idempotency_key="spawn")
                refused["spawn"] = await session.result(call_id)
            assert process.returncode is None
            for name, body in refused.items():
                assert body["ok"] is False and body["error"]["code"] == errors.RESOURCE_EXHAUSTED, (name, body)
            assert refused["spawn"]["error"]["message"].startswith("The command could not be started")
            assert not (layout.workspace / "g.txt").exists()

            # The shortage freed every key: the same key runs the call now.
            for tool, params in [*calls.items(), ("spawn", calls["execute_shell_command"])]:
                key = f"key-{tool}" if tool != "spawn" else "spawn"
                name = "execute_shell_command" if tool == "spawn" else tool
                retry = await session.call(name, params, idempotency_key=key)
                kind, body = await answer_kind(session, retry)
                assert kind == "tool.result" and body["ok"] is True, (tool, body)
            assert (layout.workspace / "g.txt").read_text() == "x\n"
        assert await process.stop() == 0
    assert_json_log(process)


async def test_accept_backs_off_while_descriptors_run_out_and_logs_one_json_line(tmp_path, authority):
    """trio's own accept loop logged each EMFILE through `logging`, ten times a second, as
    multi-line text with a traceback."""
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        connected = trio.Event()

        async def connect() -> None:
            async with client.connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                connected.set()

        async with trio.open_nursery() as nursery:
            with descriptors_exhausted(process.proc.pid):
                nursery.start_soon(connect)
                # The connection waits in the backlog while accept fails, well past the
                # first back-off steps.
                with trio.fail_after(10):
                    while "http.accept_failed" not in process.log_text():
                        await trio.sleep(0.05)
                await trio.sleep(server.ACCEPT_BACKOFF_INITIAL_S * 8)
                assert not connected.is_set()
                assert process.returncode is None
            # Accepted within one back-off once descriptors are back.
            with trio.fail_after(server.ACCEPT_BACKOFF_MAX_S + 5):
                await connected.wait()
        assert await process.stop() == 0
    events = assert_json_log(process)
    failed = [e for e in events if e["event"] == "http.accept_failed"]
    # Several failed accepts (back-off 0.1, 0.2, 0.4 … s), one line for the interval.
    assert len(failed) == 1 and failed[0]["errno"] == "EMFILE"


def test_accept_back_off_doubles_up_to_its_maximum() -> None:
    waits = [server.next_accept_backoff(None)]
    for _ in range(10):
        waits.append(server.next_accept_backoff(waits[-1]))
    assert waits[0] == server.ACCEPT_BACKOFF_INITIAL_S
    assert waits == sorted(waits) and waits[-1] == server.ACCEPT_BACKOFF_MAX_S


def test_accept_failures_are_logged_once_per_interval_with_the_rest_counted(log_lines) -> None:
    failures = server.AcceptFailures()
    for _ in range(5):
        failures.note(OSError(errno.EMFILE, "Too many open files"), 0.1)
    failures.note(OSError(errno.ENFILE, "Too many open files in system"), 0.1)
    assert failures.drain() == {"EMFILE": 4, "ENFILE": 1}
    failures.note(OSError(errno.ENOBUFS, "No buffer space available"), 0.1)
    logged = [line for line in log_lines() if line["event"] == "http.accept_failed"]
    assert [line["errno"] for line in logged] == ["EMFILE", "ENOBUFS"]


@pytest.mark.parametrize("number", [errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.ENOSPC])
def test_a_spawn_refused_for_a_shortage_is_resource_exhausted(number) -> None:
    """fork's EAGAIN (the process limit) and ENOMEM cannot be provoked for root here (root
    is above RLIMIT_NPROC); the errno's answer is checked directly."""
    failure = start_failure(OSError(number, os.strerror(number)))
    assert failure.code == errors.RESOURCE_EXHAUSTED and failure.frees_key


def test_a_spawn_refused_for_another_reason_stays_internal() -> None:
    failure = start_failure(OSError(errno.EACCES, "Permission denied"))
    assert failure.code == errors.INTERNAL and not failure.frees_key
    assert os_failure(OSError(errno.EIO, "Input/output error"), "written").code == errors.INTERNAL


@contextmanager
def small_tmpfs(path: Any) -> Iterator[None]:
    """A TMPFS_BYTES tmpfs mounted on `path` (skips the test where mounting is not allowed)."""
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a full disk (needs root): {mounted.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_a_patch_on_a_full_disk_frees_its_key_and_a_retry_after_space_returns_applies_it(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    with small_tmpfs(layout.workspace):
        filler = layout.workspace / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        async with in_process_daemon(layout) as daemon:
            client = daemon.client()
            async with client.connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                params = {"path": "g.txt", "base_sha": ZERO_SHA, "diff": CREATE_G}
                first = await session.call("apply_file_patch", params, idempotency_key="patch")
                kind, body = await answer_kind(session, first)
                assert kind == "tool.result" and body["ok"] is False
                assert body["error"]["code"] == errors.RESOURCE_EXHAUSTED, body
                # The atomic write left nothing behind: no target, no temp file.
                assert sorted(os.listdir(layout.workspace)) == ["filler"]

                filler.unlink()
                retry = await session.call("apply_file_patch", params, idempotency_key="patch")
                kind, body = await answer_kind(session, retry)
                assert kind == "tool.result" and body["ok"] is True, body
                assert (layout.workspace / "g.txt").read_text() == "x\n"


async def test_a_stop_while_descriptors_run_out_ends_the_commands_and_exits_0(tmp_path, authority):
    """stop_all asked /proc whether each group was alive and crashed on EMFILE."""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 300})
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            call_id = await session.call("execute_shell_command", {"command": "sleep 30"}, idempotency_key="long")
            started = await session.receive_until(lambda f: f["kind"] == "exec.started")
            with descriptors_exhausted(process.proc.pid):
                process.send_signal(signal.SIGTERM)
                result = await session.result(call_id)
                assert await process.wait() == 0
    assert result["ok"] is True and result["result"]["signal"] in ("SIGTERM", "SIGKILL")
    assert group_members(started["body"]["pgid"]) == []
    events = assert_json_log(process)
    assert [e["exit_code"] for e in events if e["event"] == "supervisor.stopped"] == [0]


def test_a_group_counts_as_alive_while_proc_cannot_be_read(monkeypatch) -> None:
    """group_alive raised OSError out of the task that asked (and ended the daemon) when
    /proc could not be listed, and answered "gone" when its members' stat files could not
    be opened."""
    from sandbox_supervisor.daemon.runtime import processes

    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert processes.group_alive(sleeper.pid)

        def no_descriptor(*_args: object, **_kwargs: object) -> Any:
            raise OSError(errno.EMFILE, "Too many open files")

        with monkeypatch.context() as patched:
            patched.setattr(type(processes.PROC), "iterdir", no_descriptor)
            assert processes.group_alive(sleeper.pid)
        with monkeypatch.context() as patched:
            patched.setattr(type(processes.PROC), "read_text", no_descriptor)
            assert processes.group_alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not processes.group_alive(sleeper.pid)
