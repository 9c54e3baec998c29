"""The daemon's side of held processes (docs/protocol.md §7.7): starting them through a
holder, tending their output and exit, the exec.* frames that act on them, adoption after a
restart, and the two ways of stopping (end them, or leave them running for the next daemon).

See `held.py` for the pieces (the control link, a tended process, the completion body) and
`holder.py` for the holder itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from datetime import datetime
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.fields import STREAMS
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED, Signal
from sandbox_supervisor.protocol.tools import StartProcessParams
from sandbox_supervisor.daemon.runtime.command_output import CLOCK_EPSILON_S, output_event
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.held import (
    COMPLETION_GRACE_S,
    HeldProcess,
    HolderGone,
    HolderLink,
    HolderSlow,
    completed_body,
    holder_alive,
)
from sandbox_supervisor.daemon.runtime.holder_launch import LAUNCH_TIMEOUT_S, HolderLaunchError, launch_holder
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    SPEC_FILE,
    STDIN_CLOSED,
    STDIN_GAP,
    ExitedEvent,
    HolderInfo,
    HolderSpec,
    Message,
    OutputEvent,
    Reply,
    TerminalSize,
    encode_close_stdin,
    encode_resize,
    encode_signal,
    encode_stdin,
    encode_terminate,
    encode_watch,
)
from sandbox_supervisor.daemon.runtime.cgroups import CommandCgroup
from sandbox_supervisor.daemon.runtime.processes import kill_leftover_group
from sandbox_supervisor.daemon.runtime.shell import (
    ShellRuntime,
    build_environment,
    command_spec,
    start_failure,
    uses_login_shell,
)
from sandbox_supervisor.daemon.runtime.spool import seal_stream, spool_dir
from sandbox_supervisor.daemon.runtime.tool import RunningCall
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import HeldRecord, StateStore, StoreError
from sandbox_supervisor.daemon.state.visibility import Audience, commands_origin, shell_view, visible

log = structlog.get_logger("supervisor.processes")

# How long a start waits for its holder to report the process spawned.
HOLDER_START_TIMEOUT_S = 10.0
# A stop that ends held processes waits this long beyond the kill grace for their ends to be
# journaled.
STOP_MARGIN_S = 2.0
# A holder that runs but does not accept its control connection is asked again this often,
# for this long, before it is given up (and its process ended).
HOLDER_CONNECT_RETRY_S = 0.05
HOLDER_CONNECT_PATIENCE_S = 5.0
# A process's end the database refused to journal is tried again after this long.
END_RETRY_S = 1.0

# Starts the holder of a spec in a directory; its holder.json (HolderLaunchError else).
Launcher = Callable[[Path, HolderSpec], Awaitable[HolderInfo]]


async def launch_in_thread(directory: Path, spec: HolderSpec) -> HolderInfo:
    """A launcher without the fork server: a new interpreter per holder (holder_launch.py),
    from a worker thread."""
    return await trio.to_thread.run_sync(launch_holder, directory, spec)

UNKNOWN_PROCESS_MESSAGE = "No such process."
NOT_RUNNING_MESSAGE = "The process has finished."
NOT_A_TERMINAL_MESSAGE = "The process has no terminal."
HOLDER_GONE_MESSAGE = "The process's holder did not answer."


class ProcessHost:
    def __init__(
        self,
        shell: ShellRuntime,
        store: StateStore,
        journal: Journal,
        nursery: trio.Nursery,
        launcher: Launcher,
        max_timeout_ms: int | None = None,
    ) -> None:
        self.shell = shell
        self.settings = shell.settings
        self.store = store
        self.journal = journal
        self.nursery = nursery
        self.launcher = launcher
        self.max_timeout_ms = max_timeout_ms
        self.processes: dict[str, HeldProcess] = {}
        # Starts past the checks and not yet recorded: they count against max_processes, and
        # a stop waits for them (`_start_done` is set, and replaced, as each one ends).
        self._starting = 0
        self._start_done = trio.Event()
        # Cgroups of ended processes whose descendants still run: ended at the stop.
        self.lingering: list[CommandCgroup] = []
        # Set once the stop has ended the lingering cgroups (`stop_all`): an ended process's
        # cgroup found busy after that (its removal was under way) is ended by its removal.
        self._swept = False

    # --- the start_process tool -------------------------------------------------------

    async def start(self, running: RunningCall) -> dict[str, Any]:
        call = running.call
        params = call.parameters
        if not isinstance(params, StartProcessParams):
            raise TypeError(f"start_process was dispatched {type(params).__name__}")
        ctx = running.context
        cwd = self.shell.admit(call, params, ctx)
        timeout_ms = params.timeout_ms if params.timeout_ms is not None else self.max_timeout_ms
        if self.max_timeout_ms is not None and timeout_ms is not None and timeout_ms > self.max_timeout_ms:
            raise ToolFailure(
                errors.INVALID_PARAMETERS, f"timeout_ms: at most {self.max_timeout_ms} (exec.process_max_timeout_ms)."
            )
        pty = params.pty
        env = build_environment(
            self.settings.base_env,
            ctx.agent_env,
            params.env,
            self.settings.account_env,
            terminal=pty is not None,
            term=None if pty is None else pty.term,
        )
        login = uses_login_shell(self.settings.login_shell, ctx.allowed_commands)
        cgroup = self._cgroup_for(call.call_id)
        spec = command_spec(
            self.settings,
            params.command,
            cwd,
            env,
            login,
            cgroup,
            timeout_s=None if timeout_ms is None else timeout_ms / 1000,
            stdin="pipe",
            pty=None if pty is None else TerminalSize(pty.rows, pty.cols),
        )
        directory = spool_dir(self.settings.state_dir, call.call_id)
        self._starting += 1
        try:
            return await self._launch(running, params, directory, spec, cgroup, str(cwd))
        finally:
            self._starting -= 1
            done, self._start_done = self._start_done, trio.Event()
            done.set()

    async def _launch(
        self,
        running: RunningCall,
        params: StartProcessParams,
        directory: Path,
        spec: HolderSpec,
        cgroup: CommandCgroup | None,
        cwd: str,
    ) -> dict[str, Any]:
        call = running.call
        ctx = running.context
        try:
            # The launcher has its own deadline (LAUNCH_TIMEOUT_S).
            info = await self.launcher(directory, spec)
        except (HolderLaunchError, OSError) as exc:
            if cgroup is not None:
                cgroup.kill()  # a launch past its deadline may have started it after all
                cgroup.remove()
            if isinstance(exc, OSError):
                raise start_failure(exc) from None
            raise ToolFailure(errors.INTERNAL, f"The process could not be started: {exc.message}.") from None
        origin = commands_origin(ctx.allowed_commands)
        record = HeldRecord(
            call_id=call.call_id,
            tool_name=call.tool_name,
            command=params.command,
            pty=params.pty is not None,
            pid=info.pid,
            pgid=info.pgid,
            start_ticks=info.start_ticks,
            holder_pid=info.holder_pid,
            holder_start_ticks=info.holder_start_ticks,
            started_at=unix_time(info.started_at),
            origin=origin,
            context_json=json.dumps(
                {"session_id": ctx.session_id, "generation": ctx.generation, "idempotency_key": call.idempotency_key}
            ),
            cgroup=None if cgroup is None or cgroup.name == call.call_id else cgroup.name,
        )
        started_body = {
            "call_id": call.call_id,
            "pid": record.pid,
            "pgid": record.pgid,
            "command": params.command,
            "cwd": cwd,
            "started_at": record.started_at,
            "context": json.loads(record.context_json),
        }
        try:
            self.journal.start_held(record, started_body)
        except StoreError:
            # Not recorded: nothing may run that no record describes.
            kill_leftover_group(record.pid, record.pgid, record.start_ticks)
            if cgroup is not None:
                cgroup.kill()
                cgroup.remove()  # busy a moment longer: left to Cgroups.close or the next start
            raise
        process = HeldProcess(record, directory, self.settings.output_limits(), cgroup=cgroup)
        self.processes[call.call_id] = process
        # Connected now, while exec.started goes out, rather than by the tending task once
        # it runs: the holder accepts on the other core meanwhile, and the first output
        # comes one scheduler pass sooner. A holder not accepting yet is asked by _tend.
        try:
            link: HolderLink | None = HolderLink.connect(directory)
        except OSError:
            link = None
        try:
            self.nursery.start_soon(self._tend, process, link)
        except BaseException:
            if link is not None:
                link.close_now()  # nobody else will: the task that would have is not started
            raise
        return {"pid": record.pid, "pgid": record.pgid, "started_at": record.started_at, "pty": record.pty}

    # --- tending ------------------------------------------------------------------------

    async def _tend(self, process: HeldProcess, link: HolderLink | None = None) -> None:
        """Follow one process until its end is journaled and its holder is gone (`link`: a
        connection made already, by the start)."""
        try:
            if link is None:
                link = await self._connect(process)
            process.link = link
        finally:
            process.linked.set()  # connected or not: a request waiting for it goes on (_ask)
        try:
            async with trio.open_nursery() as nursery:
                if link is not None:
                    nursery.start_soon(self._follow, process, link)
                    try:
                        await link.request(encode_watch())
                    except (HolderGone, HolderSlow):
                        pass  # the spool and exit record still say everything; the pump reads them
                await self._pump(process, link)
                nursery.cancel_scope.cancel()
        except Exception:
            log.exception("process.tend_crashed", call_id=process.call_id)
        finally:
            process.close_files()
            if link is not None:
                # Without a checkpoint: a stop's cancellation landing here would skip what
                # follows (the process forgotten, its cgroup removed).
                link.close_now()
            if process.ended.is_set():
                self.processes.pop(process.call_id, None)
                if process.cgroup is not None:
                    await self._remove_cgroup(process.cgroup)

    async def _remove_cgroup(self, cgroup: CommandCgroup) -> None:
        """Remove an ended process's cgroup in a worker thread: an rmdir waits for the kernel
        to take the group offline (up to 20 ms measured, ready_cgroups.py), and the event loop
        serves every session's frames meanwhile. Shielded, so that a stop that cancels the
        tending waits for the rmdir (bounded) rather than lose track of the cgroup."""
        with trio.CancelScope(shield=True):
            if await trio.to_thread.run_sync(cgroup.remove):
                return
            # Still busy: a descendant outlived the process and its holder (a server it
            # started in the background, say). It keeps running, as a command's background
            # descendants do (§7.4.5), until the stop ends it: with the lingering ones, or,
            # when the stop has swept them while this removal was under way, here (a v1 kill
            # can wait seconds for the freezer: a worker thread's wait too). A cgroup the
            # kill leaves busy a moment longer goes with the leftovers (Cgroups.close, or
            # the next start's `kill_leftovers`).
            if self._swept:
                await trio.to_thread.run_sync(_kill_and_remove, cgroup)
            else:
                self.lingering.append(cgroup)

    async def _connect(self, process: HeldProcess) -> HolderLink | None:
        """A link to the process's holder, or None once it is gone. A holder that still runs
        is asked again for a while: a failed connect must not be taken for its end (which
        would end the process)."""
        with trio.move_on_after(HOLDER_CONNECT_PATIENCE_S):
            while True:
                try:
                    return HolderLink.connect(process.directory)
                except OSError:
                    if not holder_alive(process.record):
                        return None
                await trio.sleep(HOLDER_CONNECT_RETRY_S)
        log.warning("holder.unreachable", call_id=process.call_id)
        return None

    def _cgroup_for(self, call_id: str) -> CommandCgroup | None:
        """The process's own cgroup (runtime/cgroups.py): one made ahead (ready_cgroups.py,
        never one offered to the host's idle shells), else one created now and named after
        the call; None without cgroups. Made ahead, its mkdirs and limits' writes are off the
        start's path, as a command's are; the record keeps its name."""
        cgroups = self.settings.cgroups
        if cgroups is None or not cgroups.enabled:
            return None
        ready = self.shell.ready_cgroups
        taken = ready.take(pooled=False) if ready is not None else None
        if taken is not None:
            return taken
        try:
            return cgroups.create(call_id)
        except OSError as exc:
            raise start_failure(exc) from None

    async def _follow(self, process: HeldProcess, link: HolderLink) -> None:
        """Read the holder's events; its link's end (the holder ended, or was killed) wakes
        the pump too, which then reads the exit record or reports the holder gone."""
        try:
            await link.run(lambda event: self._on_event(process, event))
        finally:
            process.wake.set()

    def _on_event(self, process: HeldProcess, event: Message) -> None:
        if isinstance(event, ExitedEvent) and process.exit is None:
            process.exit = event.record
        elif isinstance(event, OutputEvent) and process.exit is None and not process.ended.is_set():
            if process.read_to[event.stream] >= event.kept:
                return  # read already (the previous event's read took these bytes too)
            # While the process runs, what the spool gained is read and journaled right here,
            # in the link's reader, as the pump would: handing it to the pump costs a task
            # switch on the way of every keystroke's echo. Nothing here awaits, so this runs
            # between two passes of the pump, never inside one. The pump is woken only when
            # something stays buffered (the throttle of a command's output): it keeps the
            # deadlines, and the process's end.
            process.read_new()
            self._flush(process, trio.current_time() * 1000, final=False, after_exit=False)
            if all(live.next_flush_at() is None for live in process.live.values()):
                return
        process.wake.set()

    async def _pump(self, process: HeldProcess, link: HolderLink | None) -> None:
        """Turn what the spool gains into exec.output events until the holder is gone; journal
        exec.completed once the process exited and its streams ended or the grace passed.
        Output after that is after_exit."""
        exited_at: float | None = None
        end_due = float("inf")  # when to journal the end (again, after the database refused)
        while True:
            process.wake = trio.Event()
            gone = link is None or link.closed.is_set()
            process.read_new()
            if process.exit is None and gone:
                # While the link lives its `exited` event says so; once it is gone (or there
                # never was one: an adopted process that ended meanwhile) the record on disk.
                process.exit = process.read_exit()
            now = trio.current_time()
            if process.exit is not None and exited_at is None:
                exited_at = now
                end_due = now + COMPLETION_GRACE_S
            if not process.ended.is_set() and (gone or now >= end_due):
                if not self._end(process, now * 1000):
                    end_due = now + END_RETRY_S
                    if gone:
                        return  # the next start reports it (its record is not ended)
            if gone:
                self._flush(process, now * 1000, final=True, after_exit=True)
                return
            self._flush(process, now * 1000, final=False, after_exit=process.ended.is_set())
            deadlines = [t / 1000 for t in (live.next_flush_at() for live in process.live.values()) if t is not None]
            if not process.ended.is_set() and end_due < math.inf:
                deadlines.append(end_due)
            # Nothing due (nothing buffered, no end pending): only the holder's next event
            # wakes it, and no cancel scope is entered and left for a deadline that never comes.
            if deadlines:
                with trio.move_on_at(min(deadlines) + CLOCK_EPSILON_S):
                    await process.wake.wait()
            else:
                await process.wake.wait()

    def _flush(self, process: HeldProcess, now_ms: float, *, final: bool, after_exit: bool) -> None:
        events = [
            output_event(process.call_id, name, chunk)
            for name, live in process.live.items()
            if final or live.due(now_ms)
            for chunk in live.flush(now_ms, final=final, after_exit=after_exit)
        ]
        if not events:
            return
        try:
            self.journal.append_held_output(process.call_id, events, process.sent(), process.record.origin)
        except StoreError:
            log.warning("exec.output_not_journaled", call_id=process.call_id, events=len(events))

    def _end(self, process: HeldProcess, now_ms: float) -> bool:
        """Journal the last live events and exec.completed, exactly once; False when the
        database refused (the caller tries again)."""
        events = [
            output_event(process.call_id, name, chunk)
            for name, live in process.live.items()
            for chunk in live.flush(now_ms, final=True)
        ]
        if process.exit is None:
            # The holder is gone without an exit record: it was killed. What it held is cut.
            for name in STREAMS:
                path = process.directory / name
                if path.exists():
                    seal_stream(path)
            kill_leftover_group(process.record.pid, process.record.pgid, process.record.start_ticks)
            if process.cgroup is not None:
                process.cgroup.kill()
        body = completed_body(process, process.exit)
        if process.cgroup is not None and process.cgroup.oom_kills():
            body["oom_killed"] = True  # present only when it happened (§7.4.3)
        try:
            self.journal.end_held(
                process.call_id,
                [*events, (EXEC_COMPLETED, body)],
                process.sent(),
                json.dumps(process.exit.to_json() if process.exit is not None else {"interrupted": True}),
                process.record.origin,
            )
        except StoreError:
            log.exception("process.end_not_journaled", call_id=process.call_id)
            return False
        process.ended.set()
        log.info("process.ended", call_id=process.call_id, exit_code=body["exit_code"], signal=body["signal"])
        return True

    # --- adoption -----------------------------------------------------------------------

    def adopt_all(self) -> int:
        """Take over every held process a previous daemon left running; report those that
        ended meanwhile. Returns how many are followed."""
        adopted = 0
        for record in self.store.held_processes():
            if record.exit_json is not None:
                continue
            directory = spool_dir(self.settings.state_dir, record.call_id)
            cgroups = self.settings.cgroups
            cgroup = cgroups.adopt(record.cgroup_name) if cgroups is not None and cgroups.enabled else None
            process = HeldProcess(record, directory, self.settings.output_limits(), cgroup=cgroup)
            self.processes[record.call_id] = process
            if not holder_alive(record):
                # Ended while no daemon ran (its exit record says how), or its holder was
                # killed: reported now, from the spool and the exit record.
                process.exit = process.read_exit()
            self.nursery.start_soon(self._tend, process)
            adopted += 1
        if adopted:
            log.info("processes.adopted", count=adopted)
        return adopted

    # --- exec.* frames ------------------------------------------------------------------

    def find(self, call_id: str) -> HeldProcess | None:
        return self.processes.get(call_id)

    def may_see_ended(self, call_id: str, audience: Audience | None) -> bool | None:
        """Whether a socket may read or name a held process that no longer runs here (ended):
        None when `call_id` is no held process. Fails closed for a held process whose record
        was forgotten (beyond the 64 kept): its limits are no longer known."""
        if audience is None or audience.sees_everything:
            return True
        record = self.store.held_record(call_id)
        if record is not None:
            return visible(shell_view(record.origin), audience)
        if (spool_dir(self.settings.state_dir, call_id) / SPEC_FILE).exists():
            return False
        return None

    def may_act(self, process: HeldProcess, audience: Audience | None) -> bool:
        """A socket acts on a process only if it may see its events (docs/protocol.md §9.1)."""
        return audience is None or visible(shell_view(process.record.origin), audience)

    async def write_stdin(self, process: HeldProcess, offset: int, data: bytes) -> dict[str, Any] | str:
        reply = await self._ask(process, encode_stdin(offset, data))
        return reply if isinstance(reply, str) else self._ack(process, offset, reply)

    async def close_stdin(self, process: HeldProcess, offset: int) -> dict[str, Any] | str:
        reply = await self._ask(process, encode_close_stdin(offset))
        return reply if isinstance(reply, str) else self._ack(process, offset, reply)

    def _ack(self, process: HeldProcess, offset: int, reply: Reply) -> dict[str, Any] | str:
        """exec.stdin_ack from the holder's answer: a gap and a closed stdin are answers the
        client acts on (next_offset, closed), not errors."""
        if not reply.ok and reply.code not in (STDIN_GAP, STDIN_CLOSED):
            return _holder_code(reply)
        fields = reply.fields
        next_offset = fields.get("next", fields.get("expected"))
        if not isinstance(next_offset, int):
            return errors.INTERNAL  # a holder that does not say where stdin stands
        return {
            "call_id": process.call_id,
            "offset": offset,
            "next_offset": next_offset,
            "closed": reply.code == STDIN_CLOSED or bool(fields.get("closed", False)),
        }

    async def resize(self, process: HeldProcess, rows: int, cols: int) -> str | None:
        reply = await self._ask(process, encode_resize(rows, cols))
        if isinstance(reply, str):
            return reply
        return None if reply.ok else _holder_code(reply)

    async def send_signal(self, process: HeldProcess, signame: Signal) -> str | None:
        reply = await self._ask(process, encode_signal(signame))
        if isinstance(reply, str):
            return reply
        return None if reply.ok else _holder_code(reply)

    async def _ask(self, process: HeldProcess, message: bytes) -> Reply | str:
        """The holder's reply, or an error code: not_running once the process ended."""
        if process.exit is not None or process.ended.is_set():
            return errors.NOT_RUNNING
        if process.link is None and not process.linked.is_set():
            # Started, and its tending task has not reached the holder yet: a client that
            # writes as soon as it has the start's result must not be told `not_running`
            # for a process that runs. The connect has its own patience (_connect).
            await process.linked.wait()
            if process.exit is not None or process.ended.is_set():
                return errors.NOT_RUNNING
        link = process.link
        if link is None:
            return errors.NOT_RUNNING
        try:
            return await link.request(message)
        except HolderGone:
            return errors.NOT_RUNNING
        except HolderSlow:
            return errors.INTERNAL  # it runs; its holder did not answer in time

    def listing(self, audience: Audience | None) -> list[dict[str, Any]]:
        """exec.processes entries the socket may see: running and recently ended."""
        listed = []
        for record in self.store.held_processes():
            if audience is not None and not visible(shell_view(record.origin), audience):
                continue
            exit = json.loads(record.exit_json) if record.exit_json is not None else None
            if exit is not None and exit.get("interrupted"):
                exit = {"exit_code": None, "signal": None, "timed_out": False}
            listed.append(
                {
                    "call_id": record.call_id,
                    "tool_name": record.tool_name,
                    "command": record.command,
                    "pid": record.pid,
                    "pgid": record.pgid,
                    "pty": record.pty,
                    "started_at": record.started_at,
                    "running": exit is None,
                    "exit": None
                    if exit is None
                    else {
                        "exit_code": exit.get("exit_code"),
                        "signal": exit.get("signal"),
                        "timed_out": bool(exit.get("timed_out", False)),
                    },
                }
            )
        return listed

    # --- stop ---------------------------------------------------------------------------

    async def stop_all(self) -> None:
        """End every held process (SIGTERM, then SIGKILL after the grace, by its holder) and
        wait, within the grace and a margin, for each end to be journaled."""
        # From here no command or process starts (7.4.1 step 4), and the starts already past
        # that check finish first (each bounded by the launch deadline), so none is missed.
        self.shell.stopping = True
        with trio.move_on_after(LAUNCH_TIMEOUT_S + STOP_MARGIN_S):
            while self._starting:
                await self._start_done.wait()
        running = [p for p in self.processes.values() if not p.ended.is_set()]
        with trio.move_on_after(self.settings.kill_grace_s + STOP_MARGIN_S):
            async with trio.open_nursery() as nursery:
                for process in running:
                    nursery.start_soon(self._terminate, process)
        for process in running:
            if not process.ended.is_set():
                # Its holder did not end it (wedged, stopped): the stop still ends the
                # process, and the holder, whose record of the end will not come. The next
                # start reports it interrupted.
                log.warning("process.holder_unresponsive", call_id=process.call_id)
                record = process.record
                kill_leftover_group(record.pid, record.pgid, record.start_ticks)
                if process.cgroup is not None:
                    process.cgroup.kill()
                if holder_alive(record):  # the same process (pid and start time), not a reuse
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(record.holder_pid, signal.SIGKILL)
        for process in self.processes.values():
            if process.cgroup is not None:
                # What outlived its process in its cgroup (a child it started with setsid,
                # which also keeps the holder reading its pipes): ended with the rest, as a
                # command's descendants are (§10.1). Without cgroups such a child escapes, as
                # it escapes a command's process group.
                process.cgroup.kill()
        # No await from here to `_swept`: a removal that finds its cgroup busy checks
        # `_swept` when its worker thread returns, so it sees either the cgroup swept here
        # (it was in `lingering`) or the flag, never neither.
        for cgroup in self.lingering:
            cgroup.kill()
            cgroup.remove()
        self.lingering.clear()
        self._swept = True

    async def _terminate(self, process: HeldProcess) -> None:
        if process.link is not None:
            try:
                await process.link.request(encode_terminate())
            except (HolderGone, HolderSlow):
                pass
        await process.ended.wait()

    def running_count(self) -> int:
        """Held processes that run or are being started (exec.max_processes counts both)."""
        return self._starting + sum(1 for p in self.processes.values() if p.exit is None)

    def live_spools(self) -> set[str]:
        """The call_ids whose spools a holder may still write (never pruned)."""
        return set(self.processes)


def _kill_and_remove(cgroup: CommandCgroup) -> None:
    """End what a busy cgroup holds and remove it (a worker thread's). A kill the kernel
    refuses is logged: nothing may be left to outlive the stop unsaid."""
    try:
        cgroup.kill()
    except OSError as exc:
        log.warning("process.cgroup_kill_failed", cgroup=cgroup.name, error=str(exc))
    cgroup.remove()


def unix_time(iso: str) -> float:
    """holder.json's UTC ISO 8601 time as Unix seconds (exec.started's started_at)."""
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return time.time()


def _holder_code(reply: Reply) -> str:
    """A holder's refusal as a protocol code: those the protocol defines pass through."""
    if reply.code in (errors.NOT_RUNNING, errors.NOT_A_TERMINAL):
        return reply.code
    return errors.INTERNAL
