"""Pre-started shells through a real daemon (docs/internals.md, "Pre-started shells"): a call
runs in a shell started before it, `exec.started` names that shell's pid, and the restart's
adoption (pid and start time as recorded) finds it after a kill -9 of the daemon. Real
daemons, real kill -9s, real command hosts."""

from __future__ import annotations

from sandbox_supervisor.daemon.runtime import command_host
from sandbox_supervisor.daemon.runtime.processes import read_stat
from sandbox_supervisor.daemon.runtime.recovery import is_command_host
from sandbox_supervisor.testing.daemon import make_layout, running_daemon
from test_command_host import DEADLINE_S, kill_daemon, start_again, started_command

STUB_PREFIX = "printf -v " + command_host.POOL_UNDERSCORE_VARIABLE


async def test_a_pooled_call_is_reported_with_its_shells_pid_and_adopted_after_a_kill_9(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    marker = layout.workspace / "go"
    command = f'echo before; echo "$$ $BASH_EXECUTION_STRING"; while [ ! -e {marker} ]; do sleep 0.02; done; echo after; exit 4'
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            # The first call is spawned fresh; the host starts an idle shell after it.
            first = await session.call("execute_shell_command", {"command": "echo $BASH_EXECUTION_STRING"}, idempotency_key="first")
            result = await session.result(first, timeout=DEADLINE_S)
            assert result["result"]["stdout"]["head"] == "echo $BASH_EXECUTION_STRING\n"
            call_id, pid = await started_command(session, client, command, "pooled")
            stat = read_stat(pid)
            assert stat is not None and is_command_host(stat.ppid)
        await kill_daemon(process)

        await start_again(process, client)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            stat = read_stat(pid)
            assert stat is not None and stat.state != "Z"  # adopted, not killed by the restart
            marker.touch()
            result = await session.result(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result
    assert result["result"]["exit_code"] == 4
    before, shell_line, after = result["result"]["stdout"]["head"].splitlines()
    # The shell that ran it was a pooled one, and exec.started named it.
    assert (before, after) == ("before", "after")
    assert shell_line.startswith(f"{pid} {STUB_PREFIX}")
