"""Start-up recovery (docs/protocol.md §10.2): before the daemon listens, every call a previous
instance left pending gets its one result, and the process groups it left are killed.

Nothing runs twice: a patch is finished or recognised as finished from the file's sha; a
shell command is never re-run — it is reported interrupted, with the output it had spooled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog

from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.calls import result_body
from sandbox_supervisor.daemon.runtime.file_tools import interrupted, recover_patch_call
from sandbox_supervisor.daemon.runtime.output import HEAD_TAIL_BYTES, StreamHeadTail
from sandbox_supervisor.daemon.runtime.spool import seal_stream, stream_path
from sandbox_supervisor.daemon.state.store import CallRecord, StateStore

log = structlog.get_logger("supervisor.recovery")

STREAMS = ("stdout", "stderr")


def kill_leftover_groups(store: StateStore, state_dir: Path) -> int:
    """Kill the groups recorded by a previous instance that still run the same processes."""
    killed = 0
    for call_id, pid, pgid, start in store.recorded_processes():
        count = processes.kill_leftover_group(pid, pgid, start)
        if count:
            log.warning("process.leftover_killed", call_id=call_id, pgid=pgid, processes=count)
        killed += count
        # A completed call's background descendants may have held its pipes when the
        # previous instance died: its streams end here, or readers would never see eof.
        for name in STREAMS:
            path = stream_path(state_dir, call_id, name)
            if path.exists():
                seal_stream(path)
        store.forget_process(call_id)
    return killed


# The result's head and tail are 8 KiB each; a little more lets both start and end on a
# character boundary.
SUMMARY_EDGE_BYTES = HEAD_TAIL_BYTES + 4


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


def _interrupted_shell(record: CallRecord, state_dir: Path) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    summaries = {}
    for name in STREAMS:
        path = stream_path(state_dir, record.call_id, name)
        state = seal_stream(path)  # the writer died: what is on disk is the whole stream
        summaries[name] = summarize_spooled(path, state.truncated, state.total)
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
        error=interrupted(
            "The supervisor stopped while the command ran; it was not run again.",
            stdout=summaries["stdout"],
            stderr=summaries["stderr"],
        ),
    )
    return [("exec.completed", completed)], body


def recover_pending_calls(store: StateStore, state_dir: Path) -> int:
    """Complete every pending call; returns how many. Groups are killed first, so an
    interrupted command's spool no longer grows while it is summarised."""
    kill_leftover_groups(store, state_dir)
    completed = 0
    for record in store.pending_calls():
        preceding: list[tuple[str, dict[str, Any]]] = []
        body = None
        try:
            if record.tool_name == "apply_file_patch":
                body = recover_patch_call(record, store)
            elif record.tool_name == "execute_shell_command":
                preceding, body = _interrupted_shell(record, state_dir)
        except Exception:  # noqa: BLE001 - one bad record must not keep the daemon down
            log.exception("recovery.failed", call_id=record.call_id, tool=record.tool_name)
            preceding, body = [], None
        if body is None:  # read_file, or a recovery that failed: reported, never re-run
            body = result_body(
                record.call_id,
                record.key,
                record.tool_name,
                error=interrupted("The supervisor stopped before the call finished."),
            )
        store.complete_call(record.key, body, preceding=preceding)
        completed += 1
    return completed
