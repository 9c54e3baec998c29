"""The command host's pieces without a daemon: its imports, the spool writer it resumes with,
and its takeover when the daemon's end of the socket closes. Real processes and files."""

from __future__ import annotations

import json
import subprocess
import sys

import trio

from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost
from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE, HolderSpec, read_exit
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter, read_state

DEADLINE_S = 10


def test_the_command_host_loads_only_the_standard_library():
    """It runs beside every command for as long as they run: no pydantic, trio or structlog."""
    code = (
        "import json, sys; import sandbox_supervisor.daemon.runtime.command_host; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    modules = json.loads(subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout)
    assert not [m for m in modules if m.split(".")[0] in {"pydantic", "pydantic_core", "trio", "structlog"}]


def test_a_resumed_spool_writer_continues_the_file_its_total_and_its_cap(tmp_path):
    path = tmp_path / "stdout"
    first = SpoolWriter(path, 10)
    first.write(b"0123456")  # the daemon's writes, then it dies (no close)
    resumed = SpoolWriter.resume(path, 10)
    assert (resumed.size, resumed.total, resumed.truncated) == (7, 7, False)
    assert resumed.write(b"789abc") == 3  # the cap goes on counting from what is kept
    resumed.close()
    assert path.read_bytes() == b"0123456789"
    state = read_state(path)
    assert state is not None and (state.total, state.kept, state.truncated, state.ended) == (13, 10, True, True)


def test_a_resumed_spool_writer_of_a_stream_without_bytes_creates_the_file(tmp_path):
    path = tmp_path / "stderr"
    resumed = SpoolWriter.resume(path, 10)
    assert resumed.write(b"late") == 4
    resumed.close()
    assert path.read_bytes() == b"late"


async def test_the_host_takes_over_when_the_daemons_end_closes(tmp_path):
    """Closing the link is what a daemon's death does: the host spools the rest of the output
    itself, records the exit, and exits."""
    directory = tmp_path / "c1"
    directory.mkdir()
    spec = HolderSpec(
        argv=("/bin/sh", "-c", "echo early; sleep 0.3; echo late; exit 5"), cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"}, stdin="null"
    )
    host = CommandHost()
    process = await host.spawn("c1", directory, spec)
    assert process.stdout is not None
    with trio.fail_after(DEADLINE_S):
        early = await process.stdout.receive_some(100)
    assert early == b"early\n"
    with open(directory / "stdout", "wb") as spooled:  # what the daemon wrote before it died
        spooled.write(early)
    host_process = host._process
    await host.aclose()  # no `done`: the host keeps the command
    with trio.fail_after(DEADLINE_S):
        while not (directory / EXIT_FILE).exists():
            await trio.sleep(0.02)
        assert host_process is not None
        await host_process.wait()  # and then it exits
    record = read_exit(directory)
    assert record is not None and record.exit_code == 5 and record.timed_out is False
    assert (directory / "stdout").read_bytes() == b"early\nlate\n"


async def test_a_bug_while_completing_an_adopted_call_does_not_stop_the_daemon(tmp_path, monkeypatch):
    """The adoption task runs in the daemon's nursery: anything it raises is logged, the
    command is released, and the call stays pending for the next start."""
    from sandbox_supervisor.daemon.runtime import adoption
    from sandbox_supervisor.daemon.runtime.recovery import Adopted
    from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
    from sandbox_supervisor.daemon.runtime.tool import RecoveryEnv
    from sandbox_supervisor.daemon.state.journal import Journal
    from sandbox_supervisor.daemon.state.store import CallRecord, RecordedProcess, StateStore

    from shell_support import rig_settings

    store = StateStore.open(tmp_path / "state")
    try:
        record = CallRecord(
            space="", key="k", tool_name="execute_shell_command", digest="d", call_id="gone-call",
            state="pending", result_seq=None, result_frame=None, result_view=None, intent_json=None,
        )

        def broken(*_args: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(adoption, "recover_one", broken)
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                shell = ShellRuntime(rig_settings(tmp_path / "state"), store, Journal(store), nursery)
                # pid 2**22 + 1 is beyond any pid: its command is gone at once.
                gone = RecordedProcess(record.call_id, 2**22 + 1, 2**22 + 1, 1, record.call_id)
                adoption.adopt(Adopted(record, gone), RecoveryEnv(store, tmp_path / "state"), Journal(store), shell)
                assert "gone-call" in shell.adopted
            assert shell.adopted == {}  # released, and the nursery ended without an error
    finally:
        store.close()


class _Steps(trio.abc.Instrument):
    """Counts the steps (resumptions) of one task."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_a_spawn_waits_for_the_hosts_answer_and_for_nothing_else(tmp_path):
    """Each pass of the event loop is paid on every command's way: a spawn takes the free lock,
    sends its request and reads the answer without yielding (trio's Lock and socket methods
    yield even when they need not wait). What is left is the wait for the answer itself."""
    spec = HolderSpec(argv=("/bin/sh", "-c", "exit 3"), cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"}, stdin="null")
    host = CommandHost()
    try:
        for name in ("warm", "c1"):
            (tmp_path / name).mkdir()
        with trio.fail_after(DEADLINE_S):
            first = await host.spawn("warm", tmp_path / "warm", spec)  # starts the host itself
            assert await first.wait() == 3
            counter = _Steps(trio.lowlevel.current_task())
            trio.lowlevel.add_instrument(counter)
            try:
                process = await host.spawn("c1", tmp_path / "c1", spec)
            finally:
                trio.lowlevel.remove_instrument(counter)
            assert await process.wait() == 3
        # One resumption once the answer is readable (a second only for a spurious wake-up);
        # the lock, the send and the read after it each cost one more before.
        assert counter.steps <= 2, counter.steps
    finally:
        await host.aclose()
