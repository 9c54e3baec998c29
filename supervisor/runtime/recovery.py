"""Start-up recovery (docs/protocol.md §10.2): before the daemon listens, every call a
previous instance left pending gets its one result, and the process groups it left are killed.

Nothing runs twice: each tool's own `recover` completes its calls (a patch is finished or
recognised as finished from the file's sha; a shell command is reported interrupted, with the
output it had spooled); a tool without one is reported interrupted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import structlog

from sandbox_supervisor.protocol.fields import STREAMS
from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.cgroups import Cgroups
from sandbox_supervisor.daemon.runtime.command_host_link import HOST_MODULE
from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE
from sandbox_supervisor.daemon.runtime.spool import remove_leftover_temporaries, seal_stream, spool_dir, stream_path
from sandbox_supervisor.daemon.runtime.files import DEFAULT_MAX_FILE_BYTES
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots
from sandbox_supervisor.daemon.runtime.tool import Event, Recovered, RecoveryEnv, interrupted, result_body
from sandbox_supervisor.daemon.runtime.registry import recoverers
from sandbox_supervisor.daemon.state.keys import CallKey
from sandbox_supervisor.daemon.state.visibility import EventView, call_result_view, commands_origin
from sandbox_supervisor.daemon.state.store import CallRecord, RecordedProcess, StateStore, StoreError

log = structlog.get_logger("supervisor.recovery")

NOT_FINISHED_MESSAGE = "The supervisor stopped before the call finished."
SHELL_TOOL = "execute_shell_command"
# How long recovery waits, at most, for command hosts to record the ends of commands that
# are gone (a host waits COMPLETION_GRACE_S for the pipes after an exit), and how often it looks.
EXIT_RECORD_WAIT_S = 1.0
EXIT_RECORD_POLL_S = 0.02


def hosted_commands(store: StateStore, state_dir: Path, pending: Collection[str]) -> dict[str, RecordedProcess]:
    """The recorded commands that still run under a command host (command_host.py) that
    outlived the previous daemon and has not yet recorded their end: left running, and
    reported once they end (ShellRuntime.adopt). By call_id."""
    running = {}
    for recorded in store.recorded_processes():
        if recorded.call_id not in pending or (spool_dir(state_dir, recorded.call_id) / EXIT_FILE).exists():
            continue
        if hosted_and_running(recorded.pid, recorded.start_ticks):
            running[recorded.call_id] = recorded
    return running


def hosted_and_running(pid: int, start_ticks: int) -> bool:
    """The command's process still exists (running, or exited and not yet reaped) as a child
    of a command host, which will record its end."""
    leader = processes.read_stat(pid)
    return leader is not None and leader.start_ticks == start_ticks and is_command_host(leader.ppid)


def is_command_host(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return False
    return HOST_MODULE.encode() in argv


def await_exit_records(
    store: StateStore, state_dir: Path, pending: Collection[str], timeout_s: float = EXIT_RECORD_WAIT_S
) -> None:
    """Give a command host that is still recording the end of a command (its pipes were
    open: it waits COMPLETION_GRACE_S after the exit) the moment it needs, so the call is
    reported with its real result rather than interrupted. Only pending shell calls whose
    process is gone and whose spool lacks exit.json are waited for, and only while some
    command host runs at all."""
    waiting = [
        recorded.call_id
        for recorded in store.recorded_processes()
        if recorded.call_id in pending and not (spool_dir(state_dir, recorded.call_id) / EXIT_FILE).exists()
    ]
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline and any_command_host():
        time.sleep(EXIT_RECORD_POLL_S)
        waiting = [c for c in waiting if not (spool_dir(state_dir, c) / EXIT_FILE).exists()]


def any_command_host() -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and is_command_host(int(entry)):
            return True
    return False


def kill_leftover_groups(
    store: StateStore, state_dir: Path, cgroups: Cgroups | None = None, keep: Mapping[str, RecordedProcess] | None = None
) -> int:
    """Kill the groups recorded by a previous instance that still run the same processes,
    and every process of the command cgroups it left (which holds what left the groups with
    setsid, what a crash between a cgroup's creation and its record started, and the idle
    shells its command host left in cgroups made ahead). Held processes that still run are
    not leftovers: their holders keep them for this daemon to adopt (docs/protocol.md
    §7.7.5); nor are the commands in `keep` (a command host still runs them, by call_id),
    whose cgroups are those their records name."""
    keep = keep or {}
    killed = 0
    if cgroups is not None and cgroups.enabled:
        held = {record.cgroup_name for record in store.held_processes() if record.exit_json is None}
        kept = {recorded.cgroup for recorded in keep.values()}
        for leftover in cgroups.kill_leftovers(keep=held | kept):
            if leftover.processes:
                log.warning("process.leftover_cgroup_killed", cgroup=leftover.name, processes=leftover.processes)
            killed += leftover.processes
    for call_id, pid, pgid, start, _cgroup in store.recorded_processes():
        if call_id in keep:
            continue
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


def remove_spool_leftovers(store: StateStore, state_dir: Path, started_at: float, keep: Collection[str] = ()) -> int:
    """Remove the empty temporary files a kill left in the spool (spool.temporary_beside's),
    except in the directories of held processes not known ended and of commands a command
    host still runs (`keep`): their holders and hosts may be alive and writing one right now
    (docs/operations.md, "Faults and what the daemon does")."""
    live = {record.call_id for record in store.held_processes() if record.exit_json is None} | set(keep)
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


class CompleteCall(Protocol):
    def __call__(
        self,
        key: CallKey | None,
        result_body: dict[str, Any],
        *,
        preceding: Sequence[Event] = (),
        view: EventView | None = None,
        origin: str | None = None,
    ) -> Any: ...


class Adopted(NamedTuple):
    """A shell call whose command still runs under the previous daemon's command host: left
    pending, and completed with its real result once the host records its end."""

    record: CallRecord
    process: RecordedProcess


class Recovery(NamedTuple):
    completed: int
    adopted: list[Adopted]


def recover_pending_calls(
    store: StateStore,
    state_dir: Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    file_owner: tuple[int, int] | None = None,
    roots: WorkspaceRoots | None = None,
    cgroups: Cgroups | None = None,
) -> Recovery:
    """Complete every pending call, except shell calls whose command a command host still
    runs (returned as `adopted`). Groups are killed first, so an interrupted command's spool
    no longer grows while it is summarised. `roots`: the daemon's opened agent.cwd, which
    recovered patches resolve from (a private one when None, closed at the end). `cgroups`:
    the daemon's, whose leftover command cgroups are killed and removed too."""
    started_at = time.time()
    # The pending shell calls: those a command host may still be recording, or running.
    shell_calls = {record.call_id for record in store.pending_calls() if record.tool_name == SHELL_TOOL}
    await_exit_records(store, state_dir, shell_calls)
    running = hosted_commands(store, state_dir, shell_calls)
    kill_leftover_groups(store, state_dir, cgroups, keep=running)
    remove_spool_leftovers(store, state_dir, started_at, keep=running)
    own_roots = roots is None
    if roots is None:
        roots = WorkspaceRoots()
    try:
        env = RecoveryEnv(store, state_dir, max_file_bytes=max_file_bytes, file_owner=file_owner, roots=roots, started_at=started_at)
        return _recover_all(store, env, running)
    finally:
        if own_roots:
            roots.close()


def _recover_all(store: StateStore, env: RecoveryEnv, running: Mapping[str, RecordedProcess]) -> Recovery:
    completed = 0
    adopted = []
    for record in store.pending_calls():
        if record.tool_name == SHELL_TOOL and record.call_id in running:
            adopted.append(Adopted(record, running[record.call_id]))
            continue
        complete_recovered(store.complete_call, record, recover_one(record, env))
        completed += 1
    return Recovery(completed, adopted)


def recover_one(record: CallRecord, env: RecoveryEnv) -> Recovered:
    """The completion of one pending call, by its tool's own recovery (interrupted when it
    has none, or when it fails)."""
    recover = recoverers().get(record.tool_name)
    if recover is not None:
        try:
            return recover(record, env)
        except (OSError, ValueError, KeyError, TypeError, StoreError):
            # One unreadable record or file (a spool gone, an intent that no longer
            # parses) must not keep the daemon down: the call is reported interrupted.
            log.exception("recovery.failed", call_id=record.call_id, tool=record.tool_name)
    return _not_finished(record)


def complete_recovered(complete: CompleteCall, record: CallRecord, recovered: Recovered) -> None:
    """Complete a recovered call through `complete` (the store's complete_call at the start,
    the live journal's for an adopted command). Who may see it (docs/protocol.md §9.1) is the
    path the recovery resolved, and the allowed_commands the call was accepted under (none
    recorded: seen as unlimited)."""
    origin = commands_origin(_recorded_commands(record))
    complete(
        record.call_key,
        recovered.body,
        preceding=recovered.preceding,
        view=call_result_view(recovered.body, recovered.view_path, origin),
        origin=origin,
    )


def _recorded_commands(record: CallRecord) -> list[str] | None:
    try:
        commands = json.loads(record.intent_json or "{}").get("allowed_commands")
    except (ValueError, AttributeError):
        return None
    return [str(name) for name in commands] if isinstance(commands, list) else None
