"""Shell calls whose command outlived the daemon that started it (docs/protocol.md §10.2).

The previous daemon died while the command ran; its command host (command_host.py) did not,
and records the command's end in the spool (exit.json). Recovery left such a call pending
(`recovery.Adopted`): a retry of its key is answered `tool.pending`, as while it ran. This
task waits for that record and completes the call with the command's real result, exactly
as recovery would have at the start: the same `recover` of the tool, journaled through the
live journal so attached sockets receive it.
"""

from __future__ import annotations

import contextlib

import structlog
import trio

from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE
from sandbox_supervisor.daemon.runtime.recovery import (
    EXIT_RECORD_POLL_S,
    EXIT_RECORD_WAIT_S,
    Adopted,
    complete_recovered,
    hosted_and_running,
    recover_one,
)
from sandbox_supervisor.daemon.runtime.shell import AdoptedGroup, ShellRuntime
from sandbox_supervisor.daemon.runtime.spool import spool_dir
from sandbox_supervisor.daemon.runtime.tool import RecoveryEnv
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StoreError

log = structlog.get_logger("supervisor.recovery")

# How often an adopted command is checked for its end (one stat and one /proc read).
ADOPTED_POLL_S = 0.05
# A completion the database refused is tried again after this long.
COMPLETE_RETRY_S = 1.0


def adopt(adopted: Adopted, env: RecoveryEnv, journal: Journal, shell: ShellRuntime) -> None:
    """From now on the shell runtime counts the command against max_processes, signals it
    (exec.signal) and ends it at a stop; a task in its nursery completes the call."""
    process = adopted.process
    group = shell.track_adopted(process.call_id, process.pid, process.pgid, process.start_ticks, process.cgroup)
    shell.nursery.start_soon(finish_adopted, adopted, env, journal, shell, group)


async def finish_adopted(
    adopted: Adopted, env: RecoveryEnv, journal: Journal, shell: ShellRuntime, group: AdoptedGroup
) -> None:
    """Wait for the adopted command's end and complete its call."""
    record = adopted.record
    try:
        exit_file = spool_dir(env.state_dir, record.call_id) / EXIT_FILE
        while not exit_file.exists() and hosted_and_running(adopted.process.pid, adopted.process.start_ticks):
            await trio.sleep(ADOPTED_POLL_S)
        # Gone: its host writes the record once the pipes close, or COMPLETION_GRACE_S later.
        with trio.move_on_after(EXIT_RECORD_WAIT_S):
            while not exit_file.exists():
                await trio.sleep(EXIT_RECORD_POLL_S)
        # What the command left in the background is ended, as recovery ends it at a start.
        await trio.to_thread.run_sync(group.kill)
        if group.cgroup is not None:
            with contextlib.suppress(OSError):  # busy or gone: the next start removes it
                group.cgroup.remove()
        while True:
            try:
                # recover_one reads the spool and the exit record (without one: interrupted).
                complete_recovered(journal.complete_call, record, recover_one(record, env))
                env.store.forget_process(record.call_id)
                break
            except StoreError:
                log.warning("recovery.adopted_not_journaled", call_id=record.call_id)
                await trio.sleep(COMPLETE_RETRY_S)
        log.info("recovery.adopted_completed", call_id=record.call_id)
    except Exception:
        # This task lives in the daemon's nursery: a bug here must not stop the daemon. The
        # call stays pending, and the next start resolves it.
        log.exception("recovery.adopted_failed", call_id=record.call_id)
    finally:
        shell.release_adopted(record.call_id)
