"""Commands start with default signal dispositions and no blocked signal however the daemon
was started.

A shell starts a background job (`daemon &`, common in sandbox start scripts) with SIGINT and
SIGQUIT ignored, and nohup with SIGHUP ignored; some process managers block signals. Ignored
and blocked signals survive fork and exec, and bash cannot undo an ignored one it was started
with. So unless the spawners put the defaults back (`holder.restore_inherited_signals`: the
command host, each holder), every command would ignore `exec.signal` SIGINT and a terminal's
Ctrl-C, and with SIGCHLD ignored the kernel would reap a command before its exit status is
read. The daemon here is started as users start it, with such signals ignored and blocked.
"""

from __future__ import annotations

import re
import signal
import uuid

import pytest
import trio

from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout, running_daemon

# SIGCHLD too: ignored, it has the kernel reap a command before its exit status is read.
IGNORED = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD)
# Not SIGTERM: the daemon itself must still stop on it at the test's end.
BLOCKED = (signal.SIGUSR1, signal.SIGALRM)
SHOW_SIGNALS = "grep -E 'Sig(Ign|Blk)' /proc/self/status"
DEADLINE_S = 20


def signal_set(status_text: str, field: str = "SigIgn") -> set[int]:
    """The signals a `SigIgn:` or `SigBlk:` line of /proc/PID/status names (a hex mask, bit
    n-1 for signal n)."""
    match = re.search(rf"{field}:\s*([0-9a-f]+)", status_text)
    assert match is not None, status_text
    mask = int(match.group(1), 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def assert_defaults(status_text: str) -> None:
    assert signal_set(status_text, "SigIgn").isdisjoint(IGNORED), status_text
    assert signal_set(status_text, "SigBlk").isdisjoint(BLOCKED), status_text


@pytest.fixture
async def started(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout, ignored_signals=IGNORED, blocked_signals=BLOCKED) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            yield process, session


async def test_the_daemon_itself_started_with_the_signals_ignored_and_blocked(started):
    process, _ = started
    # The premise of the tests below: SIGQUIT, which the daemon does not handle, is still
    # ignored in the daemon's own process, and the blocked ones are blocked.
    with open(f"/proc/{process.proc.pid}/status") as status:
        text = status.read()
    assert signal.SIGQUIT in signal_set(text, "SigIgn")
    assert set(BLOCKED) <= signal_set(text, "SigBlk")


async def test_a_shell_command_starts_with_none_of_them_ignored_or_blocked(started):
    _, session = started
    result = await session.call_and_wait(
        "execute_shell_command", {"command": SHOW_SIGNALS}, idempotency_key=f"k-{uuid.uuid4()}"
    )
    assert result["ok"], result
    assert_defaults(result["result"]["stdout"]["head"])


async def test_a_shell_commands_exit_status_is_its_own(started):
    _, session = started
    result = await session.call_and_wait(
        "execute_shell_command", {"command": "exit 3"}, idempotency_key=f"k-{uuid.uuid4()}"
    )
    assert result["ok"], result
    assert result["result"]["exit_code"] == 3


@pytest.mark.parametrize("pty", [None, {"rows": 24, "cols": 80}], ids=["pipes", "terminal"])
async def test_a_held_process_starts_with_none_of_them_ignored_or_blocked(started, pty):
    _, session = started
    params = {"command": SHOW_SIGNALS, **({"pty": pty} if pty else {})}
    call_id = await session.call("start_process", params, idempotency_key=f"k-{uuid.uuid4()}")
    assert (await session.result(call_id, timeout=DEADLINE_S))["ok"]
    completed = await session.exec_completed(call_id, timeout=DEADLINE_S)
    assert completed["exit_code"] == 0, completed
    assert_defaults(completed["stdout"]["head"])


@pytest.fixture
def sigint_ignored():
    """This process (the in-process daemon's) ignores SIGINT, as a test run started in the
    background does: the daemon then installs no handler of its own that exec would reset."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def test_exec_signal_sigint_ends_a_command_of_a_daemon_that_ignores_it(sigint_ignored, tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for tool in ("execute_shell_command", "start_process"):
                call_id = await session.call(tool, {"command": "sleep 30"}, idempotency_key=f"k-{uuid.uuid4()}")
                with trio.fail_after(DEADLINE_S):
                    await session.receive_until(
                        lambda f: f["kind"] == "exec.started" and f["body"]["call_id"] == call_id
                    )
                await session.send("exec.signal", {"call_id": call_id, "signal": "SIGINT"})
                completed = await session.exec_completed(call_id, timeout=DEADLINE_S)
                assert completed["signal"] == "SIGINT", (tool, completed)
