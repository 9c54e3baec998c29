"""A held process is written to as soon as its start has returned: the request waits for the
tending task's link to the holder instead of answering `not_running` for a process that runs.

Found when the daemon's control socket got faster: the demo's first keystroke into a fresh
terminal (sent as soon as start_process's result arrived) came before the tending task had
connected to the holder, and was answered `not_running`. Real holders, a real `cat`; the
write below comes right after `start` returns, with no checkpoint between them."""

from __future__ import annotations

from pathlib import Path

import trio

from sandbox_supervisor.daemon.runtime.process_host import ProcessHost, launch_in_thread
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from shell_support import command_call, rig_settings

DEADLINE_S = 20.0


async def test_a_write_right_after_the_start_is_acknowledged_not_refused(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with StateStore.open(state_dir) as store:
        journal = Journal(store)
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                shell = ShellRuntime(rig_settings(state_dir), store, journal, nursery)
                host = ProcessHost(shell, store, journal, nursery, launch_in_thread)
                running = command_call(workspace, "start_process", "cat")
                await host.start(running)
                process = host.find(running.call.call_id)
                assert process is not None and process.link is None  # not tended yet
                ack = await host.write_stdin(process, 0, b"typed at once\n")
                assert ack == {"call_id": running.call.call_id, "offset": 0, "next_offset": 14, "closed": False}
                closed = await host.close_stdin(process, 14)
                assert isinstance(closed, dict) and closed["closed"] is True
                await process.ended.wait()  # cat ends at the end of its input
                await shell.host.aclose()
