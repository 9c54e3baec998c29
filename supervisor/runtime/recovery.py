"""Start-up recovery (docs/protocol.md §10.2): before the daemon listens, every call a
previous instance left pending gets its one result, and the process groups it left are killed.

Nothing runs twice: each tool's own `recover` completes its calls (a patch is finished or
recognised as finished from the file's sha; a shell command is reported interrupted, with the
output it had spooled); a tool without one is reported interrupted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import structlog

from sandbox_supervisor.protocol.fields import STREAMS
from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.cgroups import Cgroups
from sandbox_supervisor.daemon.runtime.spool import remove_leftover_temporaries, seal_stream, stream_path
from sandbox_supervisor.daemon.runtime.files import DEFAULT_MAX_FILE_BYTES
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots
from sandbox_supervisor.daemon.runtime.tool import Recovered, RecoveryEnv, interrupted, result_body
from sandbox_supervisor.daemon.runtime.registry import recoverers
from sandbox_supervisor.daemon.state.visibility import call_result_view, commands_origin
from sandbox_supervisor.daemon.state.store import CallRecord, StateStore, StoreError

log = structlog.get_logger("supervisor.recovery")

NOT_FINISHED_MESSAGE = "The supervisor stopped before the call finished."


def kill_leftover_groups(store: StateStore, state_dir: Path, cgroups: Cgroups | None = None) -> int:
    """Kill the groups recorded by a previous instance that still run the same processes,
    and every process of the command cgroups it left (which holds what left the groups with
    setsid, and what a crash between a cgroup's creation and its record started). Held
    processes that still run are not leftovers: their holders keep them for this daemon to
    adopt (docs/protocol.md §7.7.5)."""
    killed = 0
    if cgroups is not None and cgroups.enabled:
        held = {record.call_id for record in store.held_processes() if record.exit_json is None}
        for leftover in cgroups.kill_leftovers(keep=held):
            if leftover.processes:
                log.warning("process.leftover_cgroup_killed", call_id=leftover.name, processes=leftover.processes)
            killed += leftover.processes
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


def remove_spool_leftovers(store: StateStore, state_dir: Path, started_at: float) -> int:
    """Remove the empty temporary files a kill left in the spool (spool.temporary_beside's),
    except in the directories of held processes not known ended: their holders may be alive
    and writing one right now (docs/operations.md, "Faults and what the daemon does")."""
    live = {record.call_id for record in store.held_processes() if record.exit_json is None}
    try:
        removed = remove_leftover_temporaries(state_dir, keep=live, older_than=started_at)
    except OSError as exc:  # a courtesy, never a reason not to start
        log.warning("recovery.leftovers_failed", error=str(exc))
        return 0
    if removed:
        log.info("recovery.leftovers_removed", where="spool", files=removed)
    return removed


def _not_finished(record: CallRecord) -> Recovered:
    return Recovered(result_body(record.call_id, record.key, record.tool_name, error=interrupted(NOT_FINISHED_MESSAGE)))


def recover_pending_calls(
    store: StateStore,
    state_dir: Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    file_owner: tuple[int, int] | None = None,
    roots: WorkspaceRoots | None = None,
    cgroups: Cgroups | None = None,
) -> int:
    """Complete every pending call; returns how many. Groups are killed first, so an
    interrupted command's spool no longer grows while it is summarised. `roots`: the
    daemon's opened agent.cwd, which recovered patches resolve from (a private one when
    None, closed at the end). `cgroups`: the daemon's, whose leftover command cgroups are
    killed and removed too."""
    started_at = time.time()
    kill_leftover_groups(store, state_dir, cgroups)
    remove_spool_leftovers(store, state_dir, started_at)
    own_roots = roots is None
    if roots is None:
        roots = WorkspaceRoots()
    try:
        env = RecoveryEnv(store, state_dir, max_file_bytes=max_file_bytes, file_owner=file_owner, roots=roots, started_at=started_at)
        return _recover_all(store, env)
    finally:
        if own_roots:
            roots.close()


def _recover_all(store: StateStore, env: RecoveryEnv) -> int:
    by_tool = recoverers()
    completed = 0
    for record in store.pending_calls():
        recover = by_tool.get(record.tool_name)
        recovered = _not_finished(record)
        if recover is not None:
            try:
                recovered = recover(record, env)
            except (OSError, ValueError, KeyError, TypeError, StoreError):
                # One unreadable record or file (a spool gone, an intent that no longer
                # parses) must not keep the daemon down: the call is reported interrupted.
                log.exception("recovery.failed", call_id=record.call_id, tool=record.tool_name)
        # Who may see it (docs/protocol.md §9.1): the path the recovery resolved, and the
        # allowed_commands the call was accepted under (none recorded: seen as unlimited).
        origin = commands_origin(_recorded_commands(record))
        store.complete_call(
            record.call_key,
            recovered.body,
            preceding=recovered.preceding,
            view=call_result_view(recovered.body, recovered.view_path, origin),
            origin=origin,
        )
        completed += 1
    return completed


def _recorded_commands(record: CallRecord) -> list[str] | None:
    try:
        commands = json.loads(record.intent_json or "{}").get("allowed_commands")
    except (ValueError, AttributeError):
        return None
    return [str(name) for name in commands] if isinstance(commands, list) else None
