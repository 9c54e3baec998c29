"""execute_shell_command: check, spawn, wait, complete (docs/protocol.md §7.4, §10).

This module is the tool. It checks a call, then sequences the two parts of a command:
- `process_group`: the command's own session and process group — spawn, wait, timeout
  (SIGTERM, SIGKILL after the grace), abandon, signals, and the groups that linger after
  their call (background descendants) until they are empty;
- `command_output`: its stdout and stderr — spool, live `exec.output` events, result
  summary — read by tasks that belong to this runtime's nursery, not to the call, so output
  from background descendants keeps arriving (`after_exit: true`) after the call completed.

The policy decisions live in plain modules: `guard` (allowed_commands), `output` (the
throttled live view), `spool` (the lossless record).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import structlog
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.fields import STREAMS, Stream
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED, Signal
from sandbox_supervisor.protocol.tools import ExecuteShellCommandParams, StartProcessParams, ToolCall
from sandbox_supervisor.daemon.config import SYSTEM_PATH, SupervisorConfig
from sandbox_supervisor.daemon.state.visibility import Audience, commands_origin, shell_view, visible
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.telemetry import Telemetry
from sandbox_supervisor.daemon.state.store import StateStore, StoreError
from sandbox_supervisor.daemon.runtime.tool import CallContext, RunningCall
from sandbox_supervisor.daemon.runtime.command_output import (
    CommandOutput,
    OutputLimits,
    SpoolBudget,
)
from sandbox_supervisor.daemon.runtime import processes
from sandbox_supervisor.daemon.runtime.cgroups import Cgroups, CommandCgroup
from sandbox_supervisor.daemon.runtime.command_host import pool_key
from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost, HostLost, SpawnFailed
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec, TerminalSize
from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ
from sandbox_supervisor.daemon.runtime.failures import SPAWN_EXHAUSTION_ERRNOS, ToolFailure, resource_failure
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots, resolve_directory, resolve_in_jail
from sandbox_supervisor.daemon.runtime.identity import CommandIdentity, account_environment
from sandbox_supervisor.daemon.runtime.process_group import LingeringGroups, ProcessGroup, signal_group
from sandbox_supervisor.daemon.runtime.ready_cgroups import ReadyCgroups
from sandbox_supervisor.daemon.runtime.spool_directories import ReadySpoolDirectories
from sandbox_supervisor.daemon.runtime.spool import (
    SpoolNotFound,
    SpoolPage,
    read_origin,
    read_range,
    spool_dir,
    stream_path,
    write_origin,
)

log = structlog.get_logger("supervisor.shell")

# Spawns of one command when its cgroup vanishes before the host's child joins it (removed
# from outside, `shell.cgroup_removed`): the second gets a fresh one; a third would only
# race the same remover again.
CGROUP_SPAWN_ATTEMPTS = 2
# What the host's join fails with when the command's cgroup is gone (ENOENT) or being
# removed (ENODEV).
CGROUP_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV})

# After the shell exits, descendants it put in the background may still hold the pipes;
# completion waits this long for them to close before it is reported (§7.4.3).
COMPLETION_GRACE_S = 0.2
FALLBACK_SHELL = "/bin/sh"
HOST_LOST_MESSAGE = "The supervisor's command host ended while the command ran; its exit status is unknown."
# The answer to a command or process sent once the stop has begun (supervisor_stopping).
STOPPING_MESSAGE = "The supervisor is stopping; the command was not started."
# TERM of a command that has a terminal (a PTY) when neither its request nor its environment
# names one: what xterm.js, the terminal of E2B's and most web front ends, emulates.
DEFAULT_TERM = "xterm-256color"
# How long a finished command's housekeeping may wait for the next command to carry it: the
# host's `done` goes with the next spawn request (CommandHost._send_spawn sends what is queued
# first), and the deletion of its process record with the next write transaction (the call's
# result, or the next call's record). An agent's commands mostly follow each other within
# this; then the host is woken once per command instead of twice (each wake-up of another
# process costs both cores on the call's path) and the record costs no transaction of its
# own. What no command carries is sent and deleted this much later.
DEFERRED_FLUSH_S = 0.05
# How long a command's exec.started, once journaled, may wait to be sent with the command's
# next event (its first output, or its exec.completed and result): most commands an agent
# runs end or print within this, and then the client is sent one write and woken once for
# the command instead of twice (on two cores, that wake-up took the CPU the command's own
# path was waiting for). A command silent for longer has its exec.started sent this much
# after its start. Held processes (start_process) are not held: their start is their answer.
EXEC_STARTED_HOLD_S = 0.01
# exec.signal's names (protocol.frames.Signal) to their numbers.
SIGNALS: dict[str, signal.Signals] = {name: signal.Signals[name] for name in get_args(Signal)}


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
    # Who commands run as; None: the daemon's own user (no `[exec] user`, or a daemon that
    # cannot switch users: app.py warns about that at start).
    identity: CommandIdentity | None = None
    # HOME, USER, LOGNAME and SHELL from the passwd entry of whoever commands run as (the
    # identity's, or the daemon's own): identity.account_environment.
    account_env: Mapping[str, str] = field(default_factory=dict)
    # `[exec] login_shell`: `<shell> -l -c`, except for guarded calls (shell_argv).
    login_shell: bool = False
    # `[exec] idle_shells`: pre-started shells the command host keeps (command_host.ShellPool).
    idle_shells: int = 0
    # One cgroup per command (runtime/cgroups.py), as detected at start; None or a
    # process-group mode: process groups alone.
    cgroups: Cgroups | None = None

    @classmethod
    def from_config(
        cls, config: SupervisorConfig, identity: CommandIdentity | None = None, cgroups: Cgroups | None = None
    ) -> ShellSettings:
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
            identity=identity,
            account_env=account_environment(identity),
            login_shell=ex.login_shell,
            idle_shells=ex.idle_shells,
            cgroups=cgroups,
        )

    def output_limits(self) -> OutputLimits:
        return OutputLimits(
            throttle_ms=self.throttle_ms,
            max_chunk_bytes=self.max_chunk_bytes,
            buffer_bytes=self.buffer_bytes,
            spool_max_bytes=self.spool_max_bytes,
        )


def default_path(home: str | None) -> str:
    """The PATH a command gets when no layer of its environment sets one: the command user's
    ~/.local/bin first (where `pip install --user`, pipx and many installers put programs,
    which Debian's ~/.profile adds only for login shells), then config.SYSTEM_PATH."""
    if not home:
        return SYSTEM_PATH
    return f"{home.rstrip('/')}/.local/bin:{SYSTEM_PATH}"


def terminal_type(requested: str | None, env: Mapping[str, str]) -> str:
    """TERM for a command that has a terminal (a PTY): the one its request names, else one its
    environment already gives, else DEFAULT_TERM."""
    return requested or env.get("TERM") or DEFAULT_TERM


def build_environment(
    base: Mapping[str, str],
    agent: Mapping[str, str],
    call: Mapping[str, str] | None,
    account: Mapping[str, str] | None = None,
    *,
    terminal: bool = False,
    term: str | None = None,
) -> dict[str, str]:
    """The default PATH, overridden by base_env, overridden by the command user's
    HOME/USER/LOGNAME/SHELL (`account`, from its passwd entry), overridden by the bootstrap's
    agent.env, overridden by the call's env — never the daemon's own environment (which may
    hold secrets). The user's entry beats base_env, whose HOME is a guess made without knowing
    the user; an explicit agent.env or env still wins. The default PATH's ~/.local/bin is the
    HOME of the trusted layers (the entry's, else base_env's), never one the caller set.

    TERM: only a command with a terminal (`terminal`, the PTY feature) gets one of its own
    (terminal_type, from the request's `term`). A command on pipes gets none unless a layer
    sets it: with a TERM, programs write colours, cursor moves and progress redraws meant for
    a screen into output that is read as text (spool, result, live events)."""
    account = account or {}
    home = account.get("HOME") or base.get("HOME")
    env = {"PATH": default_path(home)}
    env.update(base)
    env.update(account)
    env.update(agent)
    env.update(call or {})
    if terminal:
        env["TERM"] = terminal_type(term, env)
    return env


def choose_shell(configured: str) -> str:
    return configured if os.access(configured, os.X_OK) else FALLBACK_SHELL


def shell_argv(shell: str, command: str, *, login: bool) -> list[str]:
    """The argv that runs `command`: `<shell> -l -c <command>` for a login shell (which reads
    /etc/profile and the user's ~/.bash_profile, ~/.bash_login or ~/.profile first, as
    E2B's `bash -l -c` does), else `<shell> -c <command>`. bash and dash both take -l."""
    return [shell, "-l", "-c", command] if login else [shell, "-c", command]


def uses_login_shell(login_shell: bool, allowed_commands: tuple[str, ...] | None) -> bool:
    """Whether this call's command runs in a login shell: only with `[exec] login_shell` and
    never for a call whose assertion has allowed_commands. A login shell runs the profile
    files before the line, and they are the agent's to write (an earlier unguarded call, or
    a guarded one's `echo … >> ~/.profile`): the guard never judged what they hold."""
    return login_shell and allowed_commands is None


def describe_exit(returncode: int) -> tuple[int | None, str | None]:
    """(exit_code, signal name) from a Popen-style return code."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"SIG{-returncode}"
    return returncode, None


def command_spec(
    settings: ShellSettings,
    command: str,
    cwd: Path,
    env: dict[str, str],
    login: bool,
    cgroup: CommandCgroup | None,
    *,
    timeout_s: float | None,
    stdin: Literal["pipe", "null"],
    pty: TerminalSize | None = None,
) -> HolderSpec:
    """How a command is spawned, by the command host (execute_shell_command) or a holder
    (start_process): the configured shell, the command user's ids, the OOM score, and its
    cgroup, which the spawned process joins itself (every directory) before it execs."""
    identity = settings.identity
    spec = HolderSpec(
        argv=tuple(shell_argv(choose_shell(settings.shell), command, login=login)),
        cwd=str(cwd),
        env=env,
        uid=None if identity is None else identity.uid,
        gid=None if identity is None else identity.gid,
        groups=None if identity is None else tuple(identity.groups),
        pty=pty,
        timeout_s=timeout_s,
        kill_grace_s=settings.kill_grace_s,
        spool_max_bytes=settings.spool_max_bytes,
        oom_score_adj=COMMAND_OOM_SCORE_ADJ,
        stdin=stdin,
    )
    return in_cgroup(spec, cgroup)


def in_cgroup(spec: HolderSpec, cgroup: CommandCgroup | None) -> HolderSpec:
    """`spec` run in `cgroup`, which the spawned process joins itself (every directory)
    before it execs; as it is for None."""
    if cgroup is None:
        return spec
    joined = cgroup.joined_in_order()
    return spec._replace(cgroup=joined[0], cgroup_also=joined[1:])


def start_failure(exc: OSError) -> ToolFailure:
    """The answer to a spawn the system refused. A shortage (no descriptor, no memory, the
    process limit, a full spool disk) is `resource_exhausted`, which frees the key: it says
    nothing about the call, so a retry once it passes must run the command, not replay this."""
    if exc.errno in SPAWN_EXHAUSTION_ERRNOS:
        return resource_failure(f"The command could not be started: {exc.strerror}; retry later.")
    return ToolFailure(errors.INTERNAL, f"The command could not be started: {exc.strerror}.")


@dataclass(eq=False)
class Command:
    """One spawned command: its process group, its output, and where its call stands."""

    call_id: str
    group: ProcessGroup
    output: CommandOutput
    started: float  # trio clock
    shell_exited: bool = False  # the group's leader has been reaped (counted as exited)
    # The call has completed: exec.completed is built and the CallRunner journals it with the
    # tool.result before this task's next checkpoint (or the call was abandoned).
    completed: trio.Event = field(default_factory=trio.Event)

    @property
    def pgid(self) -> int:
        return self.group.pgid

    def send_signal(self, signum: int) -> bool:
        """Signal the whole group. False when no process of it is left."""
        return self.group.send_signal(signum)


@dataclass(eq=False)
class AdoptedGroup:
    """A command a previous daemon started that still runs under its command host (the
    call stays pending until the host records its end: runtime/adoption.py). Signalled, stopped
    and counted like this daemon's own commands; its pgid is signalled only while its leader
    is still the recorded process (pid and start time)."""

    call_id: str
    pid: int
    pgid: int
    start_ticks: int
    cgroup: CommandCgroup | None = None
    done: trio.Event = field(default_factory=trio.Event)  # its call completed

    def leader_is_ours(self) -> bool:
        stat = processes.read_stat(self.pid)
        return stat is not None and stat.start_ticks == self.start_ticks

    def send_signal(self, signum: int) -> bool:
        if self.leader_is_ours():
            return signal_group(self.cgroup, self.pgid, signum)
        # The pgid is signalled only while the leader is the recorded process: after a
        # restart nothing else tells that the number still names this command's group.
        # What outlived the leader is still in its cgroup.
        try:
            return self.cgroup is not None and self.cgroup.signal(signum) > 0
        except OSError:
            return False

    def kill(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.kill()
        processes.kill_leftover_group(self.pid, self.pgid, self.start_ticks)


class ShellRuntime:
    def __init__(
        self,
        settings: ShellSettings,
        store: StateStore,
        journal: Journal,
        nursery: trio.Nursery,
        telemetry: Telemetry | None = None,
        roots: WorkspaceRoots | None = None,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        # The daemon's opened agent.cwd (paths.WorkspaceRoots); None: opened per call.
        self.roots = roots
        self.store = store
        self.journal = journal
        self.nursery = nursery
        # Commands whose call has not completed or whose group still has processes, by call_id
        # (finished ones are dropped: exec.* frames then answer from the spool).
        self.commands: dict[str, Command] = {}
        self._starting = 0  # spawns in progress: counted against max_processes too
        self._spools = SpoolBudget(settings.state_dir, settings.spool_total_max_bytes, keep=self._spools_to_keep)
        # Spool directories made ahead, off the call's path (spool_directories.py).
        self.ready_spools = ReadySpoolDirectories(settings.state_dir, nursery)
        # Cgroups made ahead, and offered to the host's idle shells (ready_cgroups.py).
        self.ready_cgroups: ReadyCgroups | None = (
            ReadyCgroups(settings.cgroups, nursery) if settings.cgroups is not None and settings.cgroups.enabled else None
        )
        self.stopping = False  # set by stop_all: no command starts after it
        # Completed commands' groups that background descendants keep alive: stop_all must
        # still find them, and each is forgotten once empty.
        self._lingering = LingeringGroups(nursery)
        # How many held processes (process_host.py) run: they share max_processes; and their
        # spools, which a prune must keep (their holders still write them).
        # The commands' parent (command_host.py), started with the first command.
        self.host = CommandHost(settings.idle_shells)
        self._flush_due = False  # a _flush_deferred task is waiting (DEFERRED_FLUSH_S)
        # Commands a previous daemon left running under its command host, by call_id.
        self.adopted: dict[str, AdoptedGroup] = {}
        self.held_running: Callable[[], int] = lambda: 0
        self.held_spools: Callable[[], set[str]] = set

    @property
    def running(self) -> int:
        own = sum(1 for command in self.commands.values() if not command.shell_exited)
        return self._starting + own + len(self.adopted)

    def track_adopted(self, call_id: str, pid: int, pgid: int, start_ticks: int, cgroup_name: str) -> AdoptedGroup:
        """Count, signal and stop an adopted command like one of ours until `release_adopted`
        (`cgroup_name`: as its process record names it)."""
        cgroups = self.settings.cgroups
        cgroup = cgroups.adopt(cgroup_name) if cgroups is not None and cgroups.enabled else None
        group = self.adopted[call_id] = AdoptedGroup(call_id, pid, pgid, start_ticks, cgroup)
        return group

    def release_adopted(self, call_id: str) -> None:
        group = self.adopted.pop(call_id, None)
        if group is not None:
            group.done.set()

    @property
    def spool_bytes(self) -> int:
        """Bytes in all spools (as counted since the last disk scan)."""
        return self._spools.bytes

    # --- the tool ------------------------------------------------------------------------

    async def execute(self, running: RunningCall) -> dict[str, Any]:
        call = running.call
        params = call.parameters
        if not isinstance(params, ExecuteShellCommandParams):
            raise TypeError(f"execute_shell_command was dispatched {type(params).__name__}")
        ctx = running.context
        cwd = self.admit(call, params, ctx)
        self._starting += 1
        try:
            command = await self._spawn(call.call_id, params, cwd, ctx)
        finally:
            self._starting -= 1
        try:
            self._record_start(command, call, params, cwd, ctx)
            if self.stopping:  # stop_all ran while this command was being spawned
                await self.terminate_group(command)
            try:
                returncode, timed_out = await command.group.wait_or_terminate(
                    params.timeout_ms / 1000, self.settings.kill_grace_s
                )
            except HostLost:
                # The command host died: the exit status went with it. What is left of the
                # group is ended, and the call reported interrupted with what was spooled.
                await self._abandon(command)
                with trio.move_on_after(COMPLETION_GRACE_S):
                    await command.output.closed.wait()
                running.final_events.extend(command.output.final_events(trio.current_time() * 1000))
                summaries: dict[str, Any] = {name: command.output.summary_body(name) for name in STREAMS}
                running.final_events.append(
                    (
                        EXEC_COMPLETED,
                        {
                            "call_id": call.call_id,
                            "exit_code": None,
                            "signal": None,
                            "timed_out": False,
                            "duration_ms": int((trio.current_time() - command.started) * 1000),
                            **summaries,
                            "interrupted": True,
                        },
                    )
                )
                raise ToolFailure(errors.INTERRUPTED, HOST_LOST_MESSAGE, summaries) from None
            self._mark_exited(command)
            oom_killed = command.group.oom_killed()
        except BaseException:
            # Cancelled (the daemon is stopping) or the journal failed: never leave a group
            # running that nobody tends. The call stays pending; the next start reports it
            # interrupted, as for a crash.
            await self._abandon(command)
            raise
        # Descendants in the background may hold the pipes open: report once they close, or
        # after the grace, whichever comes first; what they print later is after_exit.
        # Mostly they closed with the shell already: then without a scope and a checkpoint
        # (a pass of the event loop on every command's way).
        if not command.output.closed.is_set():
            with trio.move_on_after(COMPLETION_GRACE_S):
                await command.output.closed.wait()
        exit_code, signame = describe_exit(returncode)
        running.final_events.extend(command.output.final_events(trio.current_time() * 1000))
        result: dict[str, Any] = {
            "exit_code": exit_code,
            "signal": signame,
            "timed_out": timed_out,
            "duration_ms": int((trio.current_time() - command.started) * 1000),
            **{name: command.output.summary_body(name) for name in STREAMS},
        }
        completed: dict[str, Any] = {**result, "call_id": call.call_id, "interrupted": False}
        if oom_killed:
            # exec.completed only: the tool.result keeps the seed's schema exactly (§7.4.3).
            completed["oom_killed"] = True
        running.final_events.append((EXEC_COMPLETED, completed))
        # From here on the output is after_exit; the CallRunner journals final_events and the
        # tool.result in one transaction right after we return (no checkpoint in between).
        self._complete(command)
        return result

    def admit(self, call: ToolCall, params: ExecuteShellCommandParams | StartProcessParams, ctx: CallContext) -> Path:
        """The checks of 7.4.1 before a spawn, in their order; the resolved cwd. Shared by
        start_process (§7.7), whose processes count against the same limit."""
        # The cwd shares the file tools' jail (agent.cwd); allowed_paths limits what file
        # tools touch, not where a command may stand.
        # Resolved by the same descriptor walk as the file tools, from agent.cwd as opened at
        # bootstrap, but spawned by path: the command runs as the command user, who can
        # reach only what that user may anyway, so a symlink swapped in after this check
        # gains the agent nothing (the file tools, which run as the daemon, use the
        # descriptors themselves).
        if self.roots is None:
            cwd = resolve_in_jail(ctx.cwd, params.cwd or ".", None)
        else:
            cwd = resolve_directory(self.roots.get(ctx.cwd), params.cwd or ".")
        if not cwd.is_dir():
            raise ToolFailure(errors.INVALID_PARAMETERS, "cwd is not a directory.")
        if ctx.allowed_commands is not None:
            # Imported on first use: the guard's tables cost ~2 MiB of an idle daemon, and
            # most assertions carry no allowed_commands.
            from sandbox_supervisor.daemon.runtime.guard import check_allowed, check_environment

            check_allowed(params.command, ctx.allowed_commands)
            # The caller's environment reaches the shell too (build_environment): names such
            # as BASH_ENV or GIT_CONFIG_* run commands the line never shows.
            check_environment(ctx.agent_env, "agent.env")
            check_environment(params.env or {}, "env")
        if self.known_call(call.call_id):
            # A call_id names one execution; its spool must never mix two commands' bytes.
            # It frees the key: a call_id is any socket's to choose, so a refusal for one that
            # another socket (a delegated one, say) took first must not decide the key.
            raise ToolFailure(
                errors.INVALID_PARAMETERS, "This call_id was already used for a command.", frees_key=True
            )
        if self.stopping:
            raise ToolFailure(errors.SUPERVISOR_STOPPING, STOPPING_MESSAGE)
        if self.running + self.held_running() >= self.settings.max_processes:
            raise ToolFailure(
                errors.TOO_MANY_PROCESSES,
                f"At most {self.settings.max_processes} commands may run at once.",
            )
        return cwd

    async def _spawn(self, call_id: str, params: ExecuteShellCommandParams, cwd: Path, ctx: CallContext) -> Command:
        env = build_environment(self.settings.base_env, ctx.agent_env, params.env, self.settings.account_env)
        login = uses_login_shell(self.settings.login_shell, ctx.allowed_commands)
        origin = commands_origin(ctx.allowed_commands)
        try:
            output = CommandOutput.open(
                self.settings.state_dir,
                call_id,
                self.settings.output_limits(),
                self.journal,
                self.telemetry,
                origin,
                # The host must not append after bytes this writer dropped, should it take
                # the stream over (the state file saying so may be refused by a full disk).
                on_truncated=functools.partial(self.host.stream_truncated, call_id),
                budget=self._spools,
                ready=self.ready_spools,
            )
        except OSError as exc:
            raise start_failure(exc) from None
        if origin is not None:
            try:
                # Who may read or signal it later, once it is no longer in memory (§9.1).
                write_origin(self.settings.state_dir, call_id, origin)
            except OSError as exc:
                output.close()
                raise start_failure(exc) from None
        cgroup: CommandCgroup | None = None
        vanished = False  # the failure is a cgroup removed from outside: nothing ran
        try:
            cgroups = self.settings.cgroups
            # Whether the host's pool runs it: then its cgroup is one the pool's idle shell
            # may be in already (ready_cgroups.py), and the spawn offers the next ones.
            unplaced = self._spec(params, cwd, env, login)
            pooled = pool_key(unplaced) is not None
            for attempt in range(CGROUP_SPAWN_ATTEMPTS):
                place: list[CommandCgroup] = []
                if cgroups is not None and cgroups.enabled:
                    ready = self.ready_cgroups
                    # Made ahead on the first attempt; a retry (the cgroup was removed from
                    # outside) makes the call's own, as when none is ready.
                    if ready is not None and attempt == 0:
                        cgroup = ready.take(pooled=pooled)
                        if pooled:
                            place = ready.offer(self.host.idle_shells)
                    if cgroup is None:
                        restored = cgroups.bases_restored
                        try:
                            # Blocking, but a few mkdir/writes on a kernel file system.
                            cgroup = cgroups.create(call_id)
                        except FileNotFoundError:
                            vanished = True  # its base again, right after it was made again
                            raise
                        if cgroups.bases_restored != restored:
                            log.warning("shell.cgroup_base_restored", call_id=call_id)
                try:
                    group = await ProcessGroup.hosted(
                        self.host,
                        call_id,
                        spool_dir(self.settings.state_dir, call_id),
                        in_cgroup(unplaced, cgroup),
                        cgroup,
                        place=[c.joined_in_order() for c in place],
                    )
                    break
                except SpawnFailed as exc:
                    # The command's cgroup was removed between its mkdir and the join (an
                    # empty cgroup is anyone's to remove: see Cgroups.create). The host's
                    # child stopped before exec, so nothing ran: made again, spawned again.
                    if cgroup is None or exc.stage != "cgroup" or exc.errno not in CGROUP_GONE_ERRNOS:
                        raise
                    if attempt + 1 == CGROUP_SPAWN_ATTEMPTS:
                        vanished = True
                        raise
                    log.warning("shell.cgroup_removed", call_id=call_id)
                    cgroup.remove()
                    cgroup = None
        except BaseException as exc:
            output.close()
            if cgroup is not None:
                cgroup.remove()
            if isinstance(exc, OSError):  # SpawnFailed included: the host said why
                # Logged with the stage the host names (cwd, exec, cgroup, …): the answer
                # carries only the strerror.
                log.warning(
                    "shell.spawn_failed",
                    call_id=call_id,
                    stage=exc.stage if isinstance(exc, SpawnFailed) else "daemon",
                    errno=errno.errorcode.get(exc.errno or 0, exc.errno),
                )
                failure = start_failure(exc)
                # Removed from outside on every attempt: it says nothing about the call and
                # nothing ran, so the key is freed, as for a shortage (a retry runs it).
                failure.frees_key = failure.frees_key or vanished
                raise failure from None
            raise
        command = Command(call_id, group, output, started=trio.current_time())
        self.commands[call_id] = command
        # Tended at once: from here on its pipes are drained whatever happens to the call.
        self.nursery.start_soon(self._tend, command)
        if self.telemetry is not None:
            self.telemetry.process_started()
        return command

    def _spec(self, params: ExecuteShellCommandParams, cwd: Path, env: dict[str, str], login: bool) -> HolderSpec:
        """What the command host runs, before its cgroup is chosen: the timeout, grace and
        spool cap are the ones the host applies itself if the daemon dies while the command
        runs."""
        return command_spec(
            self.settings, params.command, cwd, env, login, None, timeout_s=params.timeout_ms / 1000, stdin="null"
        )

    def _record_start(
        self, command: Command, call: ToolCall, params: ExecuteShellCommandParams, cwd: Path, ctx: CallContext
    ) -> None:
        """Record the group (for the next start's clean-up) and journal exec.started, in one
        transaction."""
        pid = command.group.pid
        cgroup = command.group.cgroup
        self.journal.start_process(
            call.call_id,
            pid,
            command.pgid,
            command.group.start_ticks() or 0,
            {
                "call_id": call.call_id,
                "pid": pid,
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
            commands_origin(ctx.allowed_commands),
            # A cgroup made ahead is named apart from the call: the record keeps its name.
            None if cgroup is None or cgroup.name == call.call_id else cgroup.name,
            hold_s=EXEC_STARTED_HOLD_S,
        )

    async def _abandon(self, command: Command) -> None:
        await command.group.abandon()
        self._mark_exited(command)
        self._complete(command)

    def _mark_exited(self, command: Command) -> None:
        if not command.shell_exited and command.group.returncode is not None:
            command.shell_exited = True
            if self.telemetry is not None:
                self.telemetry.process_exited()

    def _complete(self, command: Command) -> None:
        # The result is journaled right after this (or the call was abandoned): the host
        # need not record the command's end for a next daemon.
        self.host.done(command.call_id)
        self._defer_flush()
        command.output.complete()
        command.completed.set()
        self._forget_if_done(command)

    def _defer_flush(self) -> None:
        if self._flush_due:
            return
        try:
            self.nursery.start_soon(self._flush_deferred)
            self._flush_due = True
        except RuntimeError:  # the nursery is closing (a stop): now
            self._flush_now()

    async def _flush_deferred(self) -> None:
        """Send the host the queued `done`s and delete the forgotten process records, at most
        DEFERRED_FLUSH_S after they were queued (the next spawn and the next write transaction
        take them sooner). A stop that cancels the runtime still does it (in the `finally`)."""
        try:
            await trio.sleep(DEFERRED_FLUSH_S)
        finally:
            self._flush_due = False
            self._flush_now()

    def _flush_now(self) -> None:
        self.host.flush()
        try:
            self.store.flush_forgotten()
        except StoreError as exc:
            # Stale rows only cost a check at the next start: their start times no longer
            # match a live process, so nothing is signalled.
            log.warning("process.forget_failed", error=str(exc))

    def _forget_if_done(self, command: Command) -> None:
        """Drop a command from memory once its call completed, its output tasks ended and
        its group is gone (and then its process record too)."""
        if not (command.completed.is_set() and command.output.finished.is_set()):
            return
        if command.group.alive():
            # Background descendants: stop_all must still find them, and the group must be
            # forgotten once they are gone — before the kernel can hand the pgid's number to
            # an unrelated process that stop_all or a restart would then signal.
            self._lingering.watch(command.group, functools.partial(self._forget, command))
            return
        self._forget(command)

    def _forget(self, command: Command) -> None:
        self._lingering.discard(command.group)
        self.commands.pop(command.call_id, None)
        # Removed by a worker thread after the call's result, with others (ReadyCgroups.retire);
        # a command has a cgroup exactly when cgroups are enabled, and so ready_cgroups is set.
        cgroup = command.group.cgroup
        if cgroup is not None and self.ready_cgroups is not None:
            self.ready_cgroups.retire(command.call_id, cgroup)
        # Deleted with the next write transaction (the call's result, when it is forgotten
        # as it completes), at the latest DEFERRED_FLUSH_S from now. A stale row, should the
        # daemon die first, only costs a check at the next start: its start time no longer
        # matches a live process, so nothing is signalled.
        self.store.forget_process_soon(command.call_id)
        self._defer_flush()

    async def terminate_group(self, command: Command) -> None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left after the grace —
        descendants that ignore SIGTERM included."""
        await command.group.terminate(self.settings.kill_grace_s)

    # --- the tasks that outlive the call -------------------------------------------------

    async def _tend(self, command: Command) -> None:
        """Run one command's output tasks, then count its spool against the disk cap.

        These tasks live in the runtime's nursery, which is the daemon's: an exception
        escaping here would cancel every other command and stop the daemon. So a bug in the
        output pipeline (an invariant of the live view broken, say) is logged with its
        traceback and costs this one command its remaining output: the readers stop and close
        the pipes, and the call completes from what was read. Cancellation is not caught."""
        try:
            await command.output.pump(command.group.pipes())
        except Exception:
            log.exception("shell.tend_crashed", call_id=command.call_id)
        finally:
            self._forget_if_done(command)
            # Its bytes were counted as they were written; its spool can be pruned now, which
            # may give the running commands' writers room again (SpoolBudget).
            if self._spools.over_cap or self._spools.full:
                await self._spools.prune()

    def _spools_to_keep(self) -> set[str]:
        """The spools a prune must not take: running commands', adopted ones' (their hosts
        still write them) and held processes'."""
        keep = {call_id for call_id, c in self.commands.items() if not c.output.finished.is_set()}
        keep |= set(self.adopted)
        return keep | self.held_spools()

    # --- exec.* frames -------------------------------------------------------------------

    def signal_command(self, call_id: str, signame: Signal) -> str | None:
        """Send a signal to a command's group; an error code, or None when sent."""
        adopted = self.adopted.get(call_id)
        if adopted is not None:
            return None if adopted.send_signal(SIGNALS[signame]) else errors.NOT_RUNNING
        command = self.commands.get(call_id)
        if command is None:
            return errors.NOT_RUNNING if self.known_call(call_id) else errors.UNKNOWN_CALL
        if command.completed.is_set() or command.shell_exited:
            return errors.NOT_RUNNING
        command.send_signal(SIGNALS[signame])
        return None

    def may_see(self, call_id: str, audience: Audience | None) -> bool:
        """Whether a socket may read or signal this command (docs/protocol.md §9.1): its output
        is shown to sockets without an allowed_commands limit, and to those whose limit is
        the very one it ran under."""
        if audience is None or audience.sees_everything or audience.commands is None:
            return True
        return visible(shell_view(read_origin(self.settings.state_dir, call_id)), audience)

    def known_call(self, call_id: str) -> bool:
        return os.path.isdir(spool_dir(self.settings.state_dir, call_id))

    def read_page(
        self, call_id: str, stream: Stream, offset: int, length: int, *, writer_alive: bool | None = None
    ) -> SpoolPage | None:
        """The spool page for exec.read_output, or None for an unknown call. `writer_alive`:
        whether more bytes may come, when the caller knows (a held process's holder writes
        them); else a command of this runtime's."""
        if not self.known_call(call_id):
            return None
        if writer_alive is None:
            command = self.commands.get(call_id)
            # An adopted command's host writes its spool until the call completes.
            writer_alive = call_id in self.adopted or (command is not None and command.output.writer_alive(stream))
        try:
            return read_range(
                stream_path(self.settings.state_dir, call_id, stream), offset, length, writer_alive=writer_alive
            )
        except SpoolNotFound:
            return None

    # --- stop ----------------------------------------------------------------------------

    async def wait_calls_completed(self) -> None:
        """Return once every command's call has completed (a command that starts meanwhile
        is waited for too). Each command's event is set where its call completes, and the
        CallRunner journals the result before that task's next checkpoint, so by the time
        this wakes the results are journaled."""
        while True:
            pending = next((c for c in self.commands.values() if not c.completed.is_set()), None)
            if pending is not None:
                await pending.completed.wait()
                continue
            adopted = next(iter(self.adopted.values()), None)
            if adopted is None:
                return
            await adopted.done.wait()

    async def stop_all(self) -> None:
        """SIGTERM every running group, SIGKILL after the grace (docs/protocol.md §10.1); the calls'
        own tasks then journal their completions. No command starts after this."""
        self.stopping = True
        running = [c for c in self.commands.values() if not c.shell_exited or c.group.alive()]
        async with trio.open_nursery() as nursery:
            for command in running:
                nursery.start_soon(self.terminate_group, command)
            for adopted in list(self.adopted.values()):
                nursery.start_soon(self._terminate_adopted, adopted)

    async def _terminate_adopted(self, adopted: AdoptedGroup) -> None:
        """As terminate_group, for a command of a previous daemon: its host records the end
        and the adoption task journals it (wait_calls_completed waits for that)."""
        if not adopted.send_signal(signal.SIGTERM):
            return
        with trio.move_on_after(self.settings.kill_grace_s):
            await adopted.done.wait()
            return
        await trio.to_thread.run_sync(adopted.kill)
