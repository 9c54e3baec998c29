"""start_process (docs/protocol.md §7.7), and its crash recovery (§10.2).

The process is the process host's (`runtime.process_host`): a holder keeps it, so it outlives
the call, the socket and the daemon. The call only starts it: its tool.result says it runs
(pid, pgid) and its call_id is its handle from then on.
"""

from __future__ import annotations

from typing import Any

from sandbox_supervisor.protocol.tools import tool_spec
from sandbox_supervisor.daemon.runtime.tool import (
    Recovered,
    RecoveryEnv,
    RunningCall,
    Tool,
    ToolServices,
    interrupted,
    result_body,
)
from sandbox_supervisor.daemon.state.store import CallRecord

NAME = "start_process"
NOT_STARTED_MESSAGE = "The supervisor stopped while the process was being started; it was not started."


def bind(services: ToolServices) -> Tool:
    async def run(running: RunningCall) -> dict[str, Any]:
        if services.processes is None:
            raise RuntimeError("start_process needs the process host")
        return await services.processes.start(running)

    return Tool(tool_spec(NAME), run=run)


def recover(record: CallRecord, env: RecoveryEnv) -> Recovered:
    """A start cut short by a crash: if its process was recorded, it runs (the next daemon
    adopts it) and the call's result says so; otherwise nothing was started that any record
    describes, and the call is reported interrupted."""
    for held in env.store.held_processes():
        if held.call_id == record.call_id:
            started = {"pid": held.pid, "pgid": held.pgid, "started_at": held.started_at, "pty": held.pty}
            return Recovered(result_body(record.call_id, record.key, record.tool_name, result=started))
    return Recovered(result_body(record.call_id, record.key, record.tool_name, error=interrupted(NOT_STARTED_MESSAGE)))
