"""execute_shell_command (docs/protocol.md §7.4), and its crash recovery (§10.2).

The command itself is the shell runtime's (`runtime.shell`): spawn, stream, spool, signal,
time out. A command is never re-run after a crash. Its parent, the command host, outlives
the daemon and records how it ended (exit.json in its spool): then the call gets its real
result; else (the host is gone too) it is reported interrupted, with the output it had
spooled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sandbox_supervisor.protocol.fields import STREAMS
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED
from sandbox_supervisor.protocol.tools import tool_spec
from sandbox_supervisor.daemon.runtime.output import HEAD_TAIL_BYTES, StreamHeadTail
from sandbox_supervisor.daemon.runtime.holder_protocol import ExitRecord, HolderProtocolError, read_exit
from sandbox_supervisor.daemon.runtime.spool import seal_stream, spool_dir, stream_path
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

NAME = "execute_shell_command"
INTERRUPTED_MESSAGE = "The supervisor stopped while the command ran; it was not run again."
# The result's head and tail are 8 KiB each; a little more lets both start and end on a
# character boundary.
SUMMARY_EDGE_BYTES = HEAD_TAIL_BYTES + 4


def bind(services: ToolServices) -> Tool:
    async def run(running: RunningCall) -> dict[str, Any]:
        return await services.shell.execute(running)

    return Tool(tool_spec(NAME), run=run)


def _exit_record(directory: Path) -> ExitRecord | None:
    try:
        return read_exit(directory)
    except HolderProtocolError:
        return None  # damaged (never half-written: it is renamed into place): not trusted


def summarize_spooled(path: Path, truncated: bool, total: int) -> dict[str, Any]:
    """The head/tail summary of a spooled stream, as the result would have carried it;
    `bytes` is what the command produced, which past the spool cap is more than was kept."""
    summary = StreamHeadTail()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size <= 2 * SUMMARY_EDGE_BYTES:
            summary.feed(handle.read())
        else:
            # Only the edges matter, and a spool can be large: read the head and the tail.
            summary.feed(handle.read(SUMMARY_EDGE_BYTES))
            handle.seek(size - SUMMARY_EDGE_BYTES)
            summary.feed(handle.read(SUMMARY_EDGE_BYTES))
    return {**summary.summary(truncated=truncated), "bytes": total}


def recover(record: CallRecord, env: RecoveryEnv) -> Recovered:
    """The call's real result when the command host recorded the command's end (exit.json:
    it ended while no daemon ran, or the daemon died before journaling its result), else
    `interrupted`, with the output spooled either way."""
    summaries = {}
    for name in STREAMS:
        path = stream_path(env.state_dir, record.call_id, name)
        state = seal_stream(path)  # the writer died: what is on disk is the whole stream
        summaries[name] = summarize_spooled(path, state.truncated, state.total)
    exit = _exit_record(spool_dir(env.state_dir, record.call_id))
    if exit is not None:
        result = {
            "exit_code": exit.exit_code,
            "signal": exit.signal,
            "timed_out": exit.timed_out,
            "duration_ms": exit.duration_ms,
            "stdout": summaries["stdout"],
            "stderr": summaries["stderr"],
        }
        body = result_body(record.call_id, record.key, record.tool_name, result=result)
        return Recovered(body, [(EXEC_COMPLETED, {**result, "call_id": record.call_id, "interrupted": False})])
    completed = {
        "exit_code": None,
        "signal": None,
        "timed_out": False,
        "duration_ms": 0,
        "stdout": summaries["stdout"],
        "stderr": summaries["stderr"],
        "call_id": record.call_id,
        "interrupted": True,
    }
    body = result_body(
        record.call_id,
        record.key,
        record.tool_name,
        error=interrupted(INTERRUPTED_MESSAGE, stdout=summaries["stdout"], stderr=summaries["stderr"]),
    )
    return Recovered(body, [(EXEC_COMPLETED, completed)])
