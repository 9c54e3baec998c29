"""execute_shell_command: spawn, stream, spool, signal, time out, complete (docs/protocol.md §7.4).

Each command runs in a new session and process group, so a signal or a kill reaches every
descendant. Its stdout and stderr are each read by one task that writes every byte to the
spool (lossless, on disk) and to a bounded live buffer; a flusher task turns the live
buffers into throttled `exec.output` events. The readers and the flusher belong to the
shell runtime's nursery, not to the call: output from background descendants keeps
arriving (`after_exit: true`) after the call has completed.

The policy decisions live in plain modules: `guard` (allowed_commands), `output` (the
throttled live view), `spool` (the lossless record); this module is the trio shell.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.tools import ExecuteShellCommandParams
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.runtime.oom import with_oom_score_adj
from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.tool import RunningCall
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.output import LiveOutput, OutputChunk, StreamHeadTail
from sandbox_supervisor.daemon.runtime.paths import resolve_in_jail
from sandbox_supervisor.daemon.runtime.spool import (
    SpoolNotFound,
    SpoolWriter,
    prune_spools,
    read_range,
    spool_dir,
    spool_usage,
    stream_path,
)
from sandbox_supervisor.daemon.state.store import StateStore, StoreError

log = structlog.get_logger("supervisor.shell")

STREAMS = ("stdout", "stderr")
READ_CHUNK_BYTES = 64 * 1024
# After the shell exits, descendants it put in the background may still hold the pipes;
# completion waits this long for them to close before it is reported (§7.4.3).
COMPLETION_GRACE_S = 0.2
FALLBACK_SHELL = "/bin/sh"
# How often a terminating group is checked for survivors (each check scans /proc).
GROUP_POLL_S = 0.05
# How often a completed command's lingering group (background descendants) is checked for
# being empty; each check scans /proc, and the daemon forgets the group after the first
# empty one.
LINGER_POLL_S = 1.0
# Reaping a SIGKILLed shell whose call was abandoned; shielded, so bounded.
ABANDON_REAP_TIMEOUT_S = 1.0
CLOCK_EPSILON_S = 1e-6
SIGNALS = {name: getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGKILL", "SIGHUP")}


@dataclass(frozen=True, slots=True)
class ShellSettings:
    shell: str
    max_processes: int
    kill_grace_s: float
    throttle_ms: float
    max_chunk_bytes: int
    buffer_bytes: int
    spool_max_bytes: int
    spool_total_max_bytes: int
    base_env: Mapping[str, str]
    state_dir: Path

    @classmethod
    def from_config(cls, config) -> ShellSettings:
        ex = config.exec
        return cls(
            shell=ex.shell,
            max_processes=ex.max_processes,
            kill_grace_s=ex.kill_grace_ms / 1000,
            throttle_ms=ex.output_throttle_ms,
            max_chunk_bytes=ex.output_max_chunk_bytes,
            buffer_bytes=ex.output_buffer_bytes,
            spool_max_bytes=ex.spool_max_bytes,
            spool_total_max_bytes=ex.spool_total_max_bytes,
            base_env=dict(ex.base_env),
            state_dir=Path(config.paths.state_dir),
        )


def build_environment(base: Mapping[str, str], agent: Mapping[str, str], call: Mapping[str, str] | None) -> dict[str, str]:
    """base_env, overridden by the bootstrap's agent.env, overridden by the call's env —
    never the daemon's own environment (which may hold secrets)."""
    env = dict(base)
    env.update(agent)
    env.update(call or {})
    return env


def choose_shell(configured: str) -> str:
    return configured if os.access(configured, os.X_OK) else FALLBACK_SHELL


def describe_exit(returncode: int) -> tuple[int | None, str | None]:
    """(exit_code, signal name) from a Popen-style return code."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"SIG{-returncode}"
    return returncode, None


def output_event(call_id: str, stream: str, chunk: OutputChunk) -> tuple[str, dict[str, Any]]:
    return ("exec.output", chunk.event_body(call_id, stream))


@dataclass(eq=False)
class StreamState:
    spool: SpoolWriter
    live: LiveOutput
    summary: StreamHeadTail
    closed: bool = False

    def summary_body(self) -> dict[str, Any]:
        return self.summary.summary(truncated=self.spool.truncated)


@dataclass(eq=False)
class Command:
    """One spawned command and the state its tasks share."""

    call_id: str
    process: trio.Process
    pgid: int
    streams: dict[str, StreamState]
    started: float  # trio clock
    shell_exited: bool = False
    completed: bool = False  # exec.completed journaled (or about to be, in one transaction)
    wake: trio.Event = field(default_factory=trio.Event)  # data, completion or close
    streams_closed: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)  # readers and flusher done

    def send_signal(self, signum: int) -> bool:
        """Signal the whole group. False when no process of it is left."""
        try:
            os.killpg(self.pgid, signum)
            return True
        except (ProcessLookupError, PermissionError):
            # PermissionError: the pgid was reused by someone else's process; not ours.
            return False


class ShellRuntime:
    def __init__(
        self, settings: ShellSettings, store: StateStore, journal: Journal, nursery: trio.Nursery, telemetry=None
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.store = store
        self.journal = journal
        self.nursery = nursery
        # Commands whose call has not completed or whose group still has processes, by call_id
        # (finished ones are dropped: exec.* frames then answer from the spool).
        self.commands: dict[str, Command] = {}
        self._starting = 0  # spawns in progress: counted against max_processes too
        # Bytes in all spools, tracked so the disk cap is checked without scanning the disk
        # after every command (a scan happens only when the cap is passed).
        self.spool_bytes = sum(u.bytes for u in spool_usage(settings.state_dir))
        self.stopping = False  # set by stop_all: no command starts after it
        # Completed commands whose groups still have processes, and whether a task is
        # sweeping them (one task for all, however many there are).
        self._lingering: set[Command] = set()
        self._sweeping = False

    @property
    def running(self) -> int:
        return self._starting + sum(1 for command in self.commands.values() if not command.shell_exited)

    # --- the tool ------------------------------------------------------------------------

    async def execute(self, running: RunningCall) -> dict[str, Any]:
        call = running.call
        params = call.parameters
        assert isinstance(params, ExecuteShellCommandParams)
        ctx = running.context
        # The cwd shares the file tools' jail (agent.cwd); allowed_paths limits what file
        # tools touch, not where a command may stand.
        cwd = resolve_in_jail(ctx.cwd, params.cwd or ".", None)
        if not cwd.is_dir():
            raise ToolFailure(errors.INVALID_PARAMETERS, "cwd is not a directory.")
        if ctx.allowed_commands is not None:
            # Imported on first use: the guard's tables cost ~2 MiB of an idle daemon, and
            # most assertions carry no allowed_commands.
            from sandbox_supervisor.daemon.runtime.guard import check_allowed

            check_allowed(params.command, ctx.allowed_commands)
        if self.known_call(call.call_id):
            # A call_id names one execution; its spool must never mix two commands' bytes.
            raise ToolFailure(errors.INVALID_PARAMETERS, "This call_id was already used for a command.")
        if self.stopping:
            raise ToolFailure(errors.INTERRUPTED, "The supervisor is stopping; the command was not started.")
        if self.running >= self.settings.max_processes:
            raise ToolFailure(
                errors.TOO_MANY_PROCESSES,
                f"At most {self.settings.max_processes} commands may run at once.",
            )
        self._starting += 1
        try:
            command = await self._spawn(call.call_id, params, cwd, ctx)
        finally:
            self._starting -= 1
        try:
            self.journal.start_process(
                call.call_id,
                command.process.pid,
                command.pgid,
                processes.start_ticks(command.process.pid) or 0,
                {
                    "call_id": call.call_id,
                    "pid": command.process.pid,
                    "pgid": command.pgid,
                    "command": params.command,
                    "cwd": str(cwd),
                    "started_at": time.time(),
                    "context": {
                        "session_id": ctx.session_id,
                        "generation": ctx.generation,
                        "idempotency_key": call.idempotency_key,
                    },
                },
            )
            if self.stopping:  # stop_all ran while this command was being spawned
                await self.terminate_group(command)
            timed_out = await self._wait(command, params.timeout_ms / 1000)
        except BaseException:
            # Cancelled (the daemon is stopping) or the journal failed: never leave a group
            # running that nobody tends. The call stays pending; the next start reports it
            # interrupted, as for a crash.
            await self._abandon(command)
            raise
        # Descendants in the background may hold the pipes open: report once they close, or
        # after the grace, whichever comes first; what they print later is after_exit.
        with trio.move_on_after(COMPLETION_GRACE_S):
            await command.streams_closed.wait()
        exit_code, signame = describe_exit(command.process.returncode)
        now_ms = trio.current_time() * 1000
        for name, stream in command.streams.items():
            for chunk in stream.live.flush(now_ms, final=True):
                running.final_events.append(output_event(call.call_id, name, chunk))
        result = {
            "exit_code": exit_code,
            "signal": signame,
            "timed_out": timed_out,
            "duration_ms": int((trio.current_time() - command.started) * 1000),
            "stdout": command.streams["stdout"].summary_body(),
            "stderr": command.streams["stderr"].summary_body(),
        }
        running.final_events.append(("exec.completed", {**result, "call_id": call.call_id, "interrupted": False}))
        # From here on the flusher marks anything new as after_exit; the CallRunner journals
        # final_events and the tool.result in one transaction right after we return.
        command.completed = True
        command.wake.set()
        self._forget_if_done(command)
        return result

    async def _abandon(self, command: Command) -> None:
        command.send_signal(signal.SIGKILL)
        with trio.move_on_after(ABANDON_REAP_TIMEOUT_S) as scope:
            scope.shield = True
            await command.process.wait()
        self._mark_exited(command)
        command.completed = True
        command.wake.set()

    def _mark_exited(self, command: Command) -> None:
        if not command.shell_exited and command.process.returncode is not None:
            command.shell_exited = True
            if self.telemetry is not None:
                self.telemetry.process_exited()

    def _forget_if_done(self, command: Command) -> None:
        """Drop a command from memory once its call completed, its output tasks ended and
        its group is gone (and then its process record too)."""
        if not (command.completed and command.finished.is_set()):
            return
        if processes.group_alive(command.pgid):
            # Background descendants: stop_all must still find them, and the group must be
            # forgotten once they are gone — before the kernel can hand the pgid's number to
            # an unrelated process that stop_all or a restart would then signal.
            self._lingering.add(command)
            if not self._sweeping:
                self._sweeping = True
                self.nursery.start_soon(self._sweep_lingering)
            return
        self._forget(command)

    def _forget(self, command: Command) -> None:
        self._lingering.discard(command)
        self.commands.pop(command.call_id, None)
        try:
            self.store.forget_process(command.call_id)
        except Exception:  # noqa: BLE001 - a stale row only costs a check at the next start
            log.warning("process.forget_failed", call_id=command.call_id)

    async def _sweep_lingering(self) -> None:
        """Forget completed commands whose groups have emptied, checking all of them with
        one /proc scan (in a worker thread) per LINGER_POLL_S, until none is left.

        A number stays reserved while any process uses it as a process group id, so the
        daemon's pgid is safe to signal until the group empties; this keeps the time after
        that (when the number may be reused) down to one poll."""
        try:
            while self._lingering:
                await trio.sleep(LINGER_POLL_S)
                # Only groups that were lingering before the scan began can be judged by it:
                # one added while the thread reads /proc may be missing from the listing.
                candidates = set(self._lingering)
                try:
                    live = await trio.to_thread.run_sync(processes.live_groups)
                except OSError as exc:  # /proc unreadable for a moment (EMFILE …): next poll
                    log.warning("process.scan_failed", error=exc.strerror)
                    continue
                for command in candidates:
                    # The scan is not atomic (a member may fork and exit while it runs), so
                    # an absent group is confirmed with killpg(pgid, 0), which is: cheap when
                    # the group is gone (ESRCH), a closer look only when it is not.
                    if command.pgid not in live and command in self._lingering:
                        if not processes.group_alive(command.pgid):
                            self._forget(command)
        finally:
            self._sweeping = False

    async def _spawn(self, call_id: str, params: ExecuteShellCommandParams, cwd: Path, ctx) -> Command:
        env = build_environment(self.settings.base_env, ctx.agent_env, params.env)
        streams: dict[str, StreamState] = {}
        try:
            for name in STREAMS:
                streams[name] = StreamState(
                    SpoolWriter(stream_path(self.settings.state_dir, call_id, name), self.settings.spool_max_bytes),
                    LiveOutput(self.settings.throttle_ms, self.settings.max_chunk_bytes, self.settings.buffer_bytes),
                    StreamHeadTail(),
                )
            # Through the oom wrapper: the value is set in the process itself before the
            # agent's shell execs, so nothing it forks can keep the daemon's protection. The
            # wrapper execs, so the pid (and group leader) the daemon tracks is the shell's.
            process = await trio.lowlevel.open_process(
                with_oom_score_adj([choose_shell(self.settings.shell), "-c", params.command]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=str(cwd),
                env=env,
                start_new_session=True,  # its own session and process group
            )
        except BaseException as exc:
            for stream in streams.values():
                stream.spool.close()
            if isinstance(exc, OSError):
                raise ToolFailure(errors.INTERNAL, f"The command could not be started: {exc.strerror}.") from None
            raise
        pgid = process.pid  # start_new_session: the shell leads its own group
        command = Command(call_id, process, pgid, streams, started=trio.current_time())
        self.commands[call_id] = command
        # Tended at once: from here on its pipes are drained whatever happens to the call.
        self.nursery.start_soon(self._tend, command)
        if self.telemetry is not None:
            self.telemetry.process_started()
        return command

    async def _wait(self, command: Command, timeout_s: float) -> bool:
        """Wait for the shell to exit; on timeout SIGTERM the group, SIGKILL after the grace.
        True when the timeout fired."""
        timed_out = False
        with trio.move_on_after(timeout_s):
            await command.process.wait()
        if command.process.returncode is None:
            timed_out = True
            await self.terminate_group(command)
        await command.process.wait()
        self._mark_exited(command)
        return timed_out

    async def terminate_group(self, command: Command) -> None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left after the grace —
        descendants that ignore SIGTERM included."""
        command.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.settings.kill_grace_s):
            while processes.group_alive(command.pgid):
                await trio.sleep(GROUP_POLL_S)
        command.send_signal(signal.SIGKILL)

    # --- the tasks that outlive the call -------------------------------------------------

    async def _tend(self, command: Command) -> None:
        """Readers and flusher of one command. A failure here is logged, never raised: these
        tasks live in the daemon's nursery, and one command must not take the daemon down."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, command, "stdout", command.process.stdout)
                nursery.start_soon(self._read, command, "stderr", command.process.stderr)
                nursery.start_soon(self._flush_live, command)
        except Exception:  # noqa: BLE001
            log.exception("shell.tend_crashed", call_id=command.call_id)
        finally:
            command.finished.set()
            for stream in command.streams.values():
                stream.spool.close()
            self._forget_if_done(command)
            self.spool_bytes += sum(stream.spool.size for stream in command.streams.values())
            if self.spool_bytes > self.settings.spool_total_max_bytes:
                await self._prune_spools()

    async def _prune_spools(self) -> None:
        keep = {call_id for call_id, c in self.commands.items() if not c.finished.is_set()}
        try:
            with trio.CancelScope(shield=True):  # a half-done prune would only be redone
                removed, self.spool_bytes = await trio.to_thread.run_sync(
                    prune_spools, self.settings.state_dir, self.settings.spool_total_max_bytes, keep
                )
        except OSError:
            log.exception("spool.prune_failed")
            return
        if removed:
            log.info("spool.pruned", calls=len(removed), bytes_left=self.spool_bytes)

    async def _read(self, command: Command, name: str, pipe: trio.abc.ReceiveStream) -> None:
        stream = command.streams[name]
        try:
            while True:
                data = await pipe.receive_some(READ_CHUNK_BYTES)
                if not data:
                    break
                kept = stream.spool.write(data)
                if self.telemetry is not None:
                    self.telemetry.output_spooled(kept)
                stream.summary.feed(data)
                stream.live.feed(data)
                command.wake.set()
        finally:
            stream.closed = True
            stream.spool.close()
            await trio.aclose_forcefully(pipe)
            if all(s.closed for s in command.streams.values()):
                command.streams_closed.set()
                command.wake.set()

    async def _flush_live(self, command: Command) -> None:
        """Emit throttled exec.output events until the call has completed and both streams
        are closed and drained. Bytes that arrive inside a throttle window wait for its end;
        the final flush before exec.completed is done by `execute`, synchronously."""
        while True:
            command.wake = trio.Event()
            now_ms = trio.current_time() * 1000
            events = [
                output_event(command.call_id, name, chunk)
                for name, stream in command.streams.items()
                if stream.live.due(now_ms)
                for chunk in stream.live.flush(now_ms, after_exit=command.completed)
            ]
            if command.completed and command.streams_closed.is_set():
                # The last bytes of descendants that outlived the shell.
                events += [
                    output_event(command.call_id, name, chunk)
                    for name, stream in command.streams.items()
                    for chunk in stream.live.flush(now_ms, final=True, after_exit=True)
                ]
                self._journal_output(command, events)
                return
            self._journal_output(command, events)
            wake_at = [t for t in (s.live.next_flush_at() for s in command.streams.values()) if t is not None]
            if wake_at:
                # A hair past the window's end: due() compares in ms, the clock is in s, and
                # waking a rounding error early would loop once for nothing.
                await trio.sleep_until(min(wake_at) / 1000 + CLOCK_EPSILON_S)
            else:
                await command.wake.wait()

    def _journal_output(self, command: Command, events: list[tuple[str, dict[str, Any]]]) -> None:
        if not events:
            return
        try:
            self.journal.append(events)
        except StoreError:
            # The live view is lossy by design: the bytes are in the spool, and the next
            # event's offset shows the gap, so a full disk costs events, not the daemon.
            log.warning("exec.output_not_journaled", call_id=command.call_id, events=len(events))

    # --- exec.* frames -------------------------------------------------------------------

    def signal_command(self, call_id: str, signame: str) -> str | None:
        """Send a signal to a command's group; an error code, or None when sent."""
        command = self.commands.get(call_id)
        if command is None:
            return errors.NOT_RUNNING if self.known_call(call_id) else errors.UNKNOWN_CALL
        if command.completed or command.shell_exited:
            return errors.NOT_RUNNING
        command.send_signal(SIGNALS[signame])
        return None

    def known_call(self, call_id: str) -> bool:
        return spool_dir(self.settings.state_dir, call_id).is_dir()

    def read_output(self, call_id: str, stream: str, offset: int, length: int) -> dict[str, Any] | None:
        """An exec.output_page body, or None for an unknown call."""
        if not self.known_call(call_id):
            return None
        command = self.commands.get(call_id)
        writer_alive = command is not None and not command.streams[stream].spool.closed
        try:
            page = read_range(
                stream_path(self.settings.state_dir, call_id, stream), offset, length, writer_alive=writer_alive
            )
        except SpoolNotFound:
            return None
        return {
            "call_id": call_id,
            "stream": stream,
            "offset": offset,
            "data": base64.b64encode(page.data).decode("ascii"),
            "eof": page.eof,
            "truncated": page.truncated,
        }

    # --- stop ----------------------------------------------------------------------------

    async def wait_calls_completed(self) -> None:
        while any(not c.completed for c in self.commands.values()):
            await trio.sleep(0.01)

    async def stop_all(self) -> None:
        """SIGTERM every running group, SIGKILL after the grace (docs/protocol.md §10.1); the calls'
        own tasks then journal their completions. No command starts after this."""
        self.stopping = True
        running = [c for c in self.commands.values() if not c.shell_exited or processes.group_alive(c.pgid)]
        async with trio.open_nursery() as nursery:
            for command in running:
                nursery.start_soon(self.terminate_group, command)
