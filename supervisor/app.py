"""The daemon assembled: build the parts, run their nurseries, drain, exit.

Nothing here decides anything about a request, a frame or a call: the front (`edge`), the
gate (`auth`), the control socket (`session`) and the tools (`runtime`) do, each over the
state (`state`, `status`) this module builds and hands them. `run_supervisor` owns the
daemon's tasks: one nursery for the listeners, the session's calls and signals.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio

from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.protocol.authority import JwksError, VerifierSettings
from sandbox_supervisor.protocol.bootstrap import BootstrapBody
from sandbox_supervisor.daemon.auth.admission import UpgradeAdmission, log_accepted
from sandbox_supervisor.daemon.auth.gate import Admit, Refuse, refuse
from sandbox_supervisor.daemon.auth.identity import SANDBOX_ID_ENV, SandboxIdentity
from sandbox_supervisor.daemon.auth.keyring import KeyRing, unusable_jwks
from sandbox_supervisor.daemon.config import JWKS_FILE_KEY, SupervisorConfig, config_problem
from sandbox_supervisor.daemon.edge import http_front
from sandbox_supervisor.daemon.edge.activation import ActivationError, open_daemon_listeners
from sandbox_supervisor.daemon.websocket import ServerWebSocket
from sandbox_supervisor.daemon.edge.server import (
    BoundListeners,
    FrontLimits,
    ListenerUnavailable,
    open_tcp_listener,
    remove_unix_paths,
    serve,
)
from sandbox_supervisor.daemon.ops.health import HTTP_UNAVAILABLE, health_response, readiness, readiness_response
from sandbox_supervisor.daemon.ops.maintenance import give_space_back
from sandbox_supervisor.daemon.ops.logs import configure_logging
from sandbox_supervisor.daemon.ops.notify import SystemdNotifier, send_watchdog_pings, watchdog_interval_s
from sandbox_supervisor.daemon.runtime import cgroups as cgroup_modes
from sandbox_supervisor.daemon.runtime.calls import CallRunner
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots
from sandbox_supervisor.daemon.runtime.identity import CommandIdentity, can_switch_user, writable_paths
from sandbox_supervisor.daemon.runtime.adoption import adopt
from sandbox_supervisor.daemon.runtime.recovery import Adopted, recover_pending_calls
from sandbox_supervisor.daemon.runtime.tool import RecoveryEnv
from sandbox_supervisor.daemon.runtime.service import Runtime
from sandbox_supervisor.daemon.runtime.holder_starter import HolderStarter
from sandbox_supervisor.daemon.runtime.process_host import ProcessHost
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime, ShellSettings
from sandbox_supervisor.daemon.runtime.tool import ToolServices
from sandbox_supervisor.daemon.runtime.registry import bind_tools
from sandbox_supervisor.daemon.session.bootstrap import BindingRules
from sandbox_supervisor.daemon.session.hub import SessionHub
from sandbox_supervisor.daemon.session.socket import (
    SessionServices,
    SocketSettings,
    retry_deferred_acks,
    serve_control_socket,
)
from sandbox_supervisor.daemon.state.integrity import StateRefused
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore, StoreError, StoreFull
from sandbox_supervisor.daemon.status import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_OK,
    EXIT_RESTART,
    EXIT_TERMINATED,
    DaemonStatus,
    Lifecycle,
    StopRequest,
)
from sandbox_supervisor.daemon.telemetry import Telemetry
from sandbox_supervisor.daemon.version import UNKNOWN_VERSION, installed_version

__all__ = ["EXIT_CONFIG", "EXIT_CRASH", "EXIT_OK", "EXIT_TERMINATED", "Daemon", "run_supervisor", "serve_main"]

log = structlog.get_logger("supervisor")

LISTENING_FILE = "listening.json"
# How often a daemon that started on a full state directory tries to open its state again,
# and a listening.json the disk refused is written again: a second brings the daemon back
# soon after space returns, at the cost of one failed open a second meanwhile.
STATE_RETRY_INTERVAL_S = 1.0
# The state database's files whose sizes make up sandbox_supervisor_journal_disk_bytes.
DB_DISK_SUFFIXES = ("", "-wal")
# After the process groups are gone, how long the stop waits for their calls to journal
# exec.completed + tool.result (the completion grace is 200 ms).
STOP_COMPLETION_BUDGET_S = 1.0


class StartupError(Exception):
    """The daemon cannot start with this configuration (exit 2)."""


@dataclass(eq=False)
class Daemon:
    """The parts of one running daemon, as assembled; `run_supervisor` hands it to whoever
    started the daemon in-process (tests, tools) once it is ready."""

    config: SupervisorConfig
    store: StateStore
    journal: Journal
    keyring: KeyRing
    identity: SandboxIdentity
    # Who commands run as; None: the daemon's own user (see command_identity).
    command_identity: CommandIdentity | None
    hub: SessionHub
    status: DaemonStatus
    notifier: SystemdNotifier
    admission: UpgradeAdmission
    telemetry: Telemetry | None
    shell: ShellRuntime | None = None  # built once the daemon's nursery is open
    processes: ProcessHost | None = None  # likewise
    holder_starter: HolderStarter | None = None  # the holders' fork server, started on first use
    runtime: Runtime | None = None
    sessions: SessionServices | None = None
    # agent.cwd, opened once for the file tools' jail (runtime/paths.py): at bootstrap, or
    # at start when the daemon restarts bound; closed when the daemon stops.
    roots: WorkspaceRoots = field(default_factory=WorkspaceRoots)
    # One cgroup per command, in the mode detected at start (None: process groups alone).
    cgroups: cgroup_modes.Cgroups | None = None

    def request_stop(self, exit_code: int, reason: str) -> None:
        self.status.request_stop(exit_code, reason)


class DaemonFront:
    """The daemon as the listeners' front sees it (`edge.server.ConnectionApp`). Built with
    `waiting` (and no daemon) when the daemon started on a full state directory: it then
    answers health and refuses upgrades `storage_full` until `daemon` is set.
    `metrics_only`: the front of the metrics listener (websocket.metrics_listen), which
    serves the metrics path and nothing else."""

    def __init__(
        self,
        daemon: Daemon | None,
        *,
        config: SupervisorConfig | None = None,
        waiting: DaemonStatus | None = None,
        identity: SandboxIdentity | None = None,
        keyring: KeyRing | None = None,
        metrics_only: bool = False,
    ) -> None:
        config = daemon.config if daemon is not None else config
        assert config is not None and (daemon is not None or waiting is not None)
        ws = config.websocket
        self.daemon = daemon
        self._waiting = waiting
        self._identity = identity
        self._keyring = keyring
        metrics = ws.metrics_path if ws.metrics_enabled else None
        if metrics_only:
            self.route_paths = http_front.RoutePaths(control=None, health=None, metrics=metrics)
        else:
            self.route_paths = http_front.RoutePaths(
                control=ws.control_path,
                health=ws.health_path,
                # With a listener of their own, metrics are not served here (a 404).
                metrics=metrics if ws.metrics_listen is None else None,
                ready=ws.ready_path,
            )
        self.handshake_timeout_s = ws.handshake_timeout_s
        self.max_message_bytes = ws.max_message_bytes

    def health(self) -> tuple[int, bytes]:
        if self.daemon is None:
            assert self._waiting is not None
            return health_response(self._waiting, storage_full=True)
        return health_response(self.daemon.status)

    def ready(self) -> tuple[int, bytes]:
        if self.daemon is None:
            assert self._waiting is not None and self._identity is not None and self._keyring is not None
            return readiness_response(readiness(self._waiting, self._identity, self._keyring, storage_full=True))
        daemon = self.daemon
        full = daemon.admission.storage_full
        return readiness_response(readiness(daemon.status, daemon.identity, daemon.keyring, storage_full=full))

    def metrics(self) -> tuple[int, bytes]:
        from sandbox_supervisor.daemon.ops.metrics import SupervisorMetrics

        if self.daemon is None:
            return HTTP_UNAVAILABLE, b""  # nothing is measured before the state is open
        telemetry = self.daemon.telemetry
        assert isinstance(telemetry, SupervisorMetrics)  # the route exists only while enabled
        return 200, telemetry.render()

    def admit_upgrade(self, head: http_front.RequestHead) -> Admit | Refuse:
        if self.daemon is None:
            # No state to check the upgrade against, and none to record it in.
            decision = refuse(errors.STORAGE_FULL, "state not opened yet: the state directory is full")
            log.info("upgrade.rejected", error=decision.code, status=decision.status, detail=decision.detail)
            return decision
        return self.daemon.admission.admit(head)

    async def run_socket(self, ws: ServerWebSocket, admit: Admit) -> None:
        assert self.daemon is not None and self.daemon.sessions is not None  # admitted only once assembled
        log_accepted(admit)  # after the 101, which the edge has written
        await serve_control_socket(ws, admit, self.daemon.sessions)


def assemble(
    config: SupervisorConfig,
    store: StateStore,
    keyring: KeyRing,
    identity: SandboxIdentity,
    notifier: SystemdNotifier,
    command_identity: CommandIdentity | None = None,
    cgroups: cgroup_modes.Cgroups | None = None,
) -> Daemon:
    """The parts that need no nursery."""
    binding = store.binding()
    status = DaemonStatus(
        version=installed_version() or UNKNOWN_VERSION,
        session=BootstrapBody.model_validate_json(binding.body_json) if binding else None,
        fence_generation=store.snapshot().fence_generation,
        privilege_separation=command_identity is not None,
        isolation=None if cgroups is None else cgroups.describe(),
    )
    journal = Journal(store)
    telemetry: Telemetry | None = None
    if config.websocket.metrics_enabled:
        # Imported only when enabled: prometheus_client costs ~2 MiB of an idle daemon.
        from sandbox_supervisor.daemon.ops.metrics import SupervisorMetrics

        metrics = SupervisorMetrics(status.version)
        # Read at scrape time from what the journal already keeps: no query per scrape.
        metrics.observe_journal(lambda: journal.last_seq, lambda: journal.pruned_through)
        telemetry = metrics
    authority = config.authority
    admission = UpgradeAdmission(
        store=store,
        keyring=keyring,
        identity=identity,
        status=status,
        verifier=VerifierSettings(
            issuer=authority.issuer,
            audience=authority.audience,
            leeway_s=authority.leeway_s,
            max_lifetime_s=authority.max_lifetime_s,
        ),
        telemetry=telemetry,
    )
    daemon = Daemon(
        config=config,
        store=store,
        journal=journal,
        keyring=keyring,
        identity=identity,
        command_identity=command_identity,
        hub=SessionHub(),
        status=status,
        notifier=notifier,
        admission=admission,
        telemetry=telemetry,
        cgroups=cgroups,
    )
    if config.websocket.metrics_enabled:
        from sandbox_supervisor.daemon.ops.metrics import SupervisorMetrics

        assert isinstance(telemetry, SupervisorMetrics)
        # A stat of the database's two files, and the running figure the spools' budget
        # keeps (runtime/command_output.SpoolBudget): no directory walk per scrape.
        telemetry.observe_disk(
            lambda: database_bytes(store.path), lambda: 0 if daemon.shell is None else daemon.shell.spool_bytes
        )
    return daemon


def database_bytes(path: Path) -> int:
    """The state database's size on disk: the file and its WAL (two stats, at each scrape)."""
    total = 0
    for suffix in DB_DISK_SUFFIXES:
        try:
            total += os.stat(f"{path}{suffix}").st_size
        except FileNotFoundError:
            pass
    return total


METRICS_LISTEN_KEY = "websocket.metrics_listen"


async def open_metrics_listener(config: SupervisorConfig) -> tuple[list[trio.SocketListener], list[str] | None]:
    """The loopback listener of websocket.metrics_listen (its listeners and bound addresses),
    or none when unset. A bind failure names the key (exit 1, as for the control listeners)."""
    address = config.websocket.metrics_listen
    if address is None:
        return [], None
    try:
        return await open_tcp_listener(address)
    except OSError as exc:
        raise ListenerUnavailable(METRICS_LISTEN_KEY, address, exc) from None


def warn_if_no_sandbox_id(identity: SandboxIdentity) -> None:
    """One line at start when no sandbox id is usable: every upgrade is refused 503 and
    /readyz answers 503 until one is (docs/operations.md, "Health and readiness")."""
    status = identity.status()
    if status.problem is not None:
        log.warning(
            "supervisor.sandbox_id_missing",
            path=str(identity.path),
            env_var=SANDBOX_ID_ENV,
            reason=status.problem,
            detail=status.detail,
        )


def start_runtime(daemon: Daemon, nursery: trio.Nursery) -> None:
    """The parts that live in the daemon's nursery: tool calls belong to the session, not to
    a socket, so they run here, outliving the connection that asked for them."""
    config = daemon.config
    who = daemon.command_identity
    roots = daemon.roots
    shell = ShellRuntime(
        ShellSettings.from_config(config, who, daemon.cgroups),
        daemon.store,
        daemon.journal,
        nursery,
        telemetry=daemon.telemetry,
        roots=roots,
    )
    # Holders are forked by one warm interpreter, not started as a new one each (~40 ms).
    daemon.holder_starter = HolderStarter()
    processes = ProcessHost(
        shell,
        daemon.store,
        daemon.journal,
        nursery,
        daemon.holder_starter.launch,
        max_timeout_ms=config.exec.process_max_timeout_ms,
    )
    shell.held_running = processes.running_count
    shell.held_spools = processes.live_spools
    tools = bind_tools(
        ToolServices(
            store=daemon.store,
            file_write_lock=trio.Lock(),
            shell=shell,
            processes=processes,
            max_file_bytes=config.files.max_file_bytes,
            file_owner=None if who is None else (who.uid, who.gid),
            roots=roots,
        )
    )
    # The jail's root is opened as soon as agent.cwd is known, so a swap of agent.cwd for a
    # symlink after that is never followed: now when the daemon restarts bound, else when a
    # bootstrap binds (DaemonStatus.on_bound).
    status = daemon.status
    if status.session is not None:
        roots.prepare(status.session.agent.cwd)
    status.on_bound = lambda body: roots.prepare(body.agent.cwd)
    calls = CallRunner(
        daemon.store,
        daemon.journal,
        nursery,
        tools,
        telemetry=daemon.telemetry,
        roots=roots,
        max_unacked_bytes=config.journal.max_unacked_bytes,
    )
    daemon.shell = shell
    daemon.processes = processes
    daemon.runtime = Runtime(calls, shell, processes)
    # Processes a previous instance left to their holders: followed again (or their end,
    # if they ended meanwhile, reported) before anyone can connect.
    processes.adopt_all()
    ws = config.websocket
    daemon.sessions = SessionServices(
        settings=SocketSettings(
            ping_interval_s=ws.ping_interval_s,
            idle_timeout_s=ws.idle_timeout_s,
            max_message_bytes=ws.max_message_bytes,
            drain_budget_s=ws.drain_budget_s,
            write_timeout_s=ws.write_timeout_s,
            rejection_receipt_timeout_s=config.bootstrap.rejection_receipt_timeout_s,
            legacy_session_control=config.authority.legacy_session_control,
        ),
        binding_rules=BindingRules(
            workspace_root=Path(config.paths.workspace_root), allowed_profiles=config.bootstrap.profiles
        ),
        store=daemon.store,
        journal=daemon.journal,
        hub=daemon.hub,
        status=daemon.status,
        runtime=daemon.runtime,
        notifier=daemon.notifier,
        telemetry=daemon.telemetry,
    )


# --- running the daemon ----------------------------------------------------------------


def write_listening_file(state_dir: Path, bound: BoundListeners, metrics: list[str] | None = None) -> None:
    """Atomically publish the bound addresses (port 0 resolved) for scripts and tests;
    `metrics`: the metrics listener's, when websocket.metrics_listen is set."""
    path = state_dir / LISTENING_FILE
    tmp = path.with_suffix(".tmp")
    listening: dict[str, list[str]] = {"tcp": bound.tcp, "unix": bound.unix}
    if metrics is not None:
        listening["metrics"] = metrics
    try:
        tmp.write_text(json.dumps(listening))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a half-written one must not be left behind
        raise


async def publish_listening_file(state_dir: Path, bound: BoundListeners, metrics: list[str] | None = None) -> None:
    """write_listening_file, retried every STATE_RETRY_INTERVAL_S while the disk refuses it
    (full): the file is a convenience for scripts, never a reason to stop serving."""
    logged = False
    while True:
        try:
            write_listening_file(state_dir, bound, metrics)
            return
        except OSError as exc:
            if not logged:
                log.warning("supervisor.listening_file_failed", error=str(exc))
                logged = True
        await trio.sleep(STATE_RETRY_INTERVAL_S)


class SignalTarget:
    """What a signal acts on: the daemon once assembled; before that (waiting for space to
    open the state) a stop is only recorded, and ends the wait."""

    def __init__(self, keyring: KeyRing) -> None:
        self.keyring = keyring
        self.daemon: Daemon | None = None
        self.stop: StopRequest | None = None
        self.stopped = trio.Event()

    def request_stop(self, exit_code: int, reason: str) -> None:
        if self.daemon is not None:
            self.daemon.request_stop(exit_code, reason)
        elif self.stop is None:
            self.stop = StopRequest(exit_code, reason)
            self.stopped.set()


async def _watch_signals(target: SignalTarget, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2) as signals:
        task_status.started()  # from here a SIGTERM is a graceful stop, not the default kill
        async for signum in signals:
            if signum == signal.SIGHUP:
                target.keyring.reload(reason="sighup")
            elif signum == signal.SIGUSR2:
                # A restart that keeps processes (docs/operations.md): the daemon stops, its
                # held processes keep running, and the next daemon adopts them.
                log.info("supervisor.signal", signal="SIGUSR2", keep_processes=True)
                target.request_stop(EXIT_RESTART, "SIGUSR2")
            else:
                log.info("supervisor.signal", signal=signal.Signals(signum).name)
                target.request_stop(EXIT_OK, signal.Signals(signum).name)


def command_identity(config: SupervisorConfig) -> CommandIdentity | None:
    """The user commands will run as, None for the daemon's own; StartupError when that user
    could write what the daemon trusts (docs/operations.md, "Privilege separation")."""
    try:
        wanted = config.exec.command_identity()
    except ValueError as exc:  # the user was removed since the configuration was loaded
        raise StartupError(config_problem("exec.user", str(exc))) from None
    if wanted is None:
        if os.geteuid() == 0:
            # The shipped unit runs the daemon as root: without [exec] user every command runs
            # as root too (an upgraded image keeps its old configuration). Never silently.
            log.warning(
                "supervisor.commands_run_as_root",
                reason="exec.user is not set and the daemon runs as root",
            )
        return None
    if not can_switch_user():
        # Still useful without it (a developer's machine): run, but never silently.
        log.warning(
            "supervisor.privilege_separation_unavailable",
            user=config.exec.user,
            reason="the daemon is not root; commands run as the daemon's own user",
        )
        return None
    state_dir = Path(config.paths.state_dir)
    # The key set is the trust anchor: a user who could write it could add its own key.
    guarded = [state_dir, state_dir / DB_FILENAME, Path(config.authority.jwks_file)]
    guarded += [Path(os.path.abspath(path)).parent for path in config.listen.unix]
    problems = writable_paths(guarded, wanted)
    if problems:
        raise StartupError(
            config_problem(
                "exec.user",
                "the command user could change the daemon's state or sockets: "
                + "; ".join(problems)
                + " (make them owned by root and not group- or world-writable)",
            )
        )
    return wanted


def detect_isolation(config: SupervisorConfig) -> cgroup_modes.Cgroups:
    """The cgroup mode for commands (docs/operations.md, "Process isolation"), prepared and
    logged once; StartupError when a configured cgroup_root cannot be used."""
    ex = config.exec
    try:
        cgroups = cgroup_modes.detect(
            ex.cgroup,
            None if ex.cgroup_root is None else str(ex.cgroup_root),
            config.paths.state_dir,
            memory_max=ex.memory_max,
            pids_max=ex.pids_max,
        )
    except ValueError as exc:
        raise StartupError(config_problem("exec.cgroup_root", str(exc))) from None
    log.info("supervisor.isolation", **cgroups.describe())
    return cgroups


def open_keyring(config: SupervisorConfig) -> KeyRing:
    path = config.authority.jwks_file
    try:
        return KeyRing(path)
    except (OSError, JwksError) as exc:
        # Worded as check-config words it (ops/cli.py).
        raise StartupError(config_problem(JWKS_FILE_KEY, unusable_jwks(path, exc))) from None


def open_store(config: SupervisorConfig) -> StateStore:
    """The state store; StoreFull when the state directory is full (the caller waits for
    space), StateRefused when the state is missing, damaged or inconsistent (exit 2, never a
    wait: a full disk is never taken for damage, state/fsutil.disk_full), StartupError for
    any other failure."""
    try:
        return StateStore.open(config.paths.state_dir, config.idempotency.retention())
    except StoreFull:
        raise
    except (OSError, StoreError) as exc:
        raise StartupError(config_problem("paths.state_dir", str(exc))) from None


def resolve_pending(
    store: StateStore, config: SupervisorConfig, who: CommandIdentity | None, roots: WorkspaceRoots, cgroups: cgroup_modes.Cgroups
) -> list[Adopted]:
    """Complete the calls a previous instance left pending, before anyone can connect, so a
    reconnecting client finds exactly one result for each of them; the shell calls whose
    commands still run under the previous instance's command host are returned instead, to be
    completed with their real results once they end (runtime/adoption.py). StoreFull when
    their results cannot be written (they stay pending: the next try resolves them)."""
    recovery = recover_pending_calls(
        store,
        config.paths.state_dir,
        max_file_bytes=config.files.max_file_bytes,
        file_owner=None if who is None else (who.uid, who.gid),
        roots=roots,
        cgroups=cgroups,
    )
    if recovery.completed:
        log.warning("calls.recovered", count=recovery.completed)
    if recovery.adopted:
        log.warning("calls.adopted", count=len(recovery.adopted))
    return recovery.adopted


async def wait_for_state(
    config: SupervisorConfig,
    who: CommandIdentity | None,
    roots: WorkspaceRoots,
    cgroups: cgroup_modes.Cgroups,
    target: SignalTarget,
) -> tuple[StateStore, list[Adopted]] | None:
    """Open the store and resolve pending calls, tried every STATE_RETRY_INTERVAL_S while
    the state directory is full; the store, or None when a stop came first. Each try runs
    the whole integrity check again (StateStore.open): StateRefused, once the state can be
    read and is not sound, ends the wait (the caller exits 2), as any other StartupError."""
    while True:
        with trio.move_on_after(STATE_RETRY_INTERVAL_S):
            await target.stopped.wait()
            return None
        try:
            store = open_store(config)
        except StoreFull:
            continue
        adopted: list[Adopted] = []
        try:
            if store.snapshot().terminated is None:
                adopted = resolve_pending(store, config, who, roots, cgroups)
        except StoreFull:
            store.close()
            continue
        except BaseException:
            store.close()
            raise
        return store, adopted


async def run_supervisor(
    config: SupervisorConfig,
    *,
    handle_signals: bool = True,
    env: MutableMapping[str, str] = os.environ,
    task_status: trio.TaskStatus[tuple[Daemon, BoundListeners]] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run until stopped; return the exit status. `task_status.started` gets the Daemon and
    the bound listeners once the daemon is ready (what READY=1 means).

    On a full state directory the daemon still starts: it binds its listeners, answers
    health (503 `storage_full`) and refuses upgrades `storage_full` with Retry-After, and
    opens its state by itself once space is freed (docs/operations.md, "Faults and what the
    daemon does")."""
    notifier = SystemdNotifier(env)
    # Before the state is opened: a state dir the command user can write is never trusted.
    who = command_identity(config)
    keyring = open_keyring(config)
    store: StateStore | None
    try:
        store = open_store(config)
    except StoreFull as exc:
        log.warning("supervisor.storage_full", error=str(exc), retry_s=STATE_RETRY_INTERVAL_S)
        store = None
    roots = WorkspaceRoots(workspace_root=str(config.paths.workspace_root))
    try:
        if store is not None and store.snapshot().terminated is not None:
            return _terminated_at_start(notifier)
        cgroups = detect_isolation(config)
        adopted: list[Adopted] = []
        if store is not None:
            try:
                adopted = resolve_pending(store, config, who, roots, cgroups)
            except StoreFull as exc:
                log.warning("supervisor.storage_full", error=str(exc), retry_s=STATE_RETRY_INTERVAL_S)
                store.close()
                store = None
        identity = SandboxIdentity(config.paths.sandbox_id_file, env)
        warn_if_no_sandbox_id(identity)
        metrics_listeners, metrics_bound = await open_metrics_listener(config)
        try:
            bound, owned_unix = await open_daemon_listeners(config.listen.tcp, config.listen.unix, env)
        except BaseException as exc:
            for listener in metrics_listeners:
                await trio.aclose_forcefully(listener)
            if isinstance(exc, ActivationError):
                raise StartupError(str(exc)) from None
            raise
        limits = FrontLimits(
            max_tcp_handshakes=config.websocket.max_handshakes,
            max_unix_handshakes=config.websocket.max_unix_handshakes,
            max_handshakes_per_peer=config.websocket.max_handshakes_per_peer,
            unix_allowed_uids=frozenset(config.listen.unix_allowed_uids),
        )
        target = SignalTarget(keyring)
        interval = watchdog_interval_s(env)
        try:
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    await nursery.start(_watch_signals, target)
                if interval is not None:
                    # Runs on the trio loop: a wedged loop stops the pings, and systemd
                    # restarts the daemon, which is what the watchdog is for.
                    nursery.start_soon(send_watchdog_pings, notifier, interval)
                front: DaemonFront | None = None
                metrics_front: DaemonFront | None = None
                if store is None:
                    # Serve health and typed refusals while waiting: a daemon that exits on
                    # a full disk is restarted into the same full disk until systemd gives
                    # up, and then nobody is left to recover when space returns.
                    waiting = DaemonStatus(
                        version=installed_version() or UNKNOWN_VERSION,
                        session=None,
                        fence_generation=0,
                        privilege_separation=who is not None,
                        isolation=cgroups.describe(),
                    )
                    front = DaemonFront(None, config=config, waiting=waiting, identity=identity, keyring=keyring)
                    await nursery.start(serve, bound.listeners, front, limits)
                    if metrics_listeners:
                        metrics_front = DaemonFront(None, config=config, waiting=waiting, metrics_only=True)
                        await nursery.start(serve, metrics_listeners, metrics_front, limits)
                    nursery.start_soon(publish_listening_file, config.paths.state_dir, bound, metrics_bound)
                    # Ready in systemd's sense (listening, answering): not restarted for a
                    # start timeout while the disk stays full.
                    notifier.notify("READY=1", "STATUS=waiting for space in the state directory")
                    waited = await wait_for_state(config, who, roots, cgroups, target)
                    store, adopted = (None, []) if waited is None else waited
                    if store is None or store.snapshot().terminated is not None:
                        early_exit = target.stop if store is None else None
                        nursery.cancel_scope.cancel()
                        return _early_exit(early_exit, notifier, cgroups)
                daemon = assemble(config, store, keyring, identity, notifier, who, cgroups)
                daemon.roots = roots
                target.daemon = daemon
                start_runtime(daemon, nursery)
                adoption_env = RecoveryEnv(store, Path(config.paths.state_dir), roots=roots)
                for pending in adopted:
                    assert daemon.shell is not None  # start_runtime made it
                    adopt(pending, adoption_env, daemon.journal, daemon.shell)
                nursery.start_soon(retry_deferred_acks, daemon.journal)
                nursery.start_soon(daemon.journal.wake_held)
                nursery.start_soon(give_space_back, daemon.store)
                if metrics_front is not None:
                    metrics_front.daemon = daemon
                elif metrics_listeners:
                    await nursery.start(serve, metrics_listeners, DaemonFront(daemon, metrics_only=True), limits)
                if front is None:
                    await nursery.start(serve, bound.listeners, DaemonFront(daemon), limits)
                    # Published once the daemon is ready (what READY=1 says): a script that
                    # waits for the file and then sends SIGTERM gets a graceful stop, never
                    # the default handler's kill before the signal watcher is installed.
                    try:
                        write_listening_file(config.paths.state_dir, bound, metrics_bound)
                    except OSError:
                        nursery.start_soon(publish_listening_file, config.paths.state_dir, bound, metrics_bound)
                else:
                    front.daemon = daemon  # from now on upgrades go through the gate
                log.info("supervisor.ready", tcp=bound.tcp, unix=bound.unix, version=daemon.status.version)
                notifier.notify("READY=1", "STATUS=serving")
                task_status.started((daemon, bound))
                await daemon.status.stop_requested.wait()
                await drain(daemon)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The state, once space let it be read, was refused (damaged, inconsistent), or
            # opening it failed otherwise: raised inside the nursery, which wraps it in a
            # group. Unwrapped, serve_main answers it as at any start: one line and exit 2,
            # never a traceback, never a fresh start.
            failure = group.exceptions[0] if len(group.exceptions) == 1 else None
            if not isinstance(failure, (StateRefused, StartupError)):
                raise
            _close_cgroups(cgroups)
            raise failure from None
        finally:
            # Only paths the daemon created: an inherited socket belongs to its socket unit.
            remove_unix_paths(owned_unix)
        _close_cgroups(cgroups)
        stop = daemon.status.stop
        assert stop is not None
        log.info("supervisor.stopped", exit_code=stop.exit_code, reason=stop.reason)
        return stop.exit_code
    finally:
        roots.close()
        if store is not None:
            store.close()


def _early_exit(stop: StopRequest | None, notifier: SystemdNotifier, cgroups: cgroup_modes.Cgroups) -> int:
    """The end of a start that waited for space: stopped meanwhile (`stop`), or the state,
    once opened, says terminated (None)."""
    _close_cgroups(cgroups)
    if stop is None:
        return _terminated_at_start(notifier)
    log.info("supervisor.stopped", exit_code=stop.exit_code, reason=stop.reason)
    return stop.exit_code


def _close_cgroups(cgroups: cgroup_modes.Cgroups) -> None:
    try:
        cgroups.close()
    except OSError as exc:  # the base directories stay; the next start reuses them
        log.warning("process.cgroup_remove_failed", error=str(exc))


def _terminated_at_start(notifier: SystemdNotifier) -> int:
    log.error("supervisor.terminated_at_start")
    notifier.notify("STOPPING=1", "STATUS=terminated after a bootstrap rejection")
    return EXIT_TERMINATED


async def drain(daemon: Daemon) -> None:
    """Refuse new upgrades; end running commands (SIGTERM, SIGKILL after the grace) so their
    completions are journaled; send every socket what the journal holds, within the drain
    budget; then close every socket with 1001 within the drain budget."""
    status = daemon.status
    if status.lifecycle is Lifecycle.SERVING:
        status.lifecycle = Lifecycle.DRAINING
        daemon.notifier.notify("STOPPING=1", "STATUS=draining")
    stop = status.stop
    if daemon.processes is not None and not (stop is not None and stop.exit_code == EXIT_RESTART):
        # A stop ends held processes too; a restart that keeps them leaves them to their holders.
        await daemon.processes.stop_all()
    if daemon.holder_starter is not None:
        await daemon.holder_starter.aclose()  # holders it started run on, or were ended above
    if daemon.shell is not None:
        await daemon.shell.stop_all()
        # The calls' own tasks journal exec.completed and tool.result once the shells
        # have exited; give them a moment beyond the completion grace.
        with trio.move_on_after(STOP_COMPLETION_BUDGET_S):
            await daemon.shell.wait_calls_completed()
        # Every command's end is known: the command host exits (one still running, past
        # the budget, is recorded by it for the next start).
        await daemon.shell.host.aclose()
    # Closing a socket cancels its sender, wherever it is: a result journaled a moment ago
    # (or a backlog a slow client has not read yet) would never be sent, and a send cut off
    # mid-frame corrupts the stream before the close frame. So every sender first catches up
    # with the journal, within the budget; past it the client gets the rest by replay.
    budget = daemon.config.websocket.drain_budget_s
    last_seq = daemon.journal.last_seq
    with trio.move_on_after(budget) as flush:
        await daemon.hub.flush_all(last_seq)
    if flush.cancelled_caught:
        behind = sorted(c.sender.cursor for c in daemon.hub.open if c.sender is not None and not c.sender.stopped)
        log.warning("drain.flush_incomplete", last_seq=last_seq, cursors=behind, budget_s=budget)
    daemon.hub.close_all(closes.CLOSE_GOING_AWAY, closes.STOPPING_REASON)
    with trio.move_on_after(budget):
        await daemon.hub.wait_all_closed()


def serve_main(config: SupervisorConfig) -> int:
    """Entry point of `sandbox-supervisor serve`."""
    configure_logging(config.logging.level, config.logging.format)
    try:
        return trio.run(run_supervisor, config)
    except StartupError as exc:
        log.error("supervisor.bad_configuration", problem=str(exc))
        return EXIT_CONFIG
    except StateRefused as exc:
        # Never a silent fresh start, never a traceback: one line saying what is wrong and
        # what the operator can do (docs/operations.md, "Faults and what the daemon does").
        log.error("supervisor.state_refused", problem=exc.problem, detail=exc.detail, action=exc.action)
        return EXIT_CONFIG
    except ListenerUnavailable as exc:
        log.error("supervisor.start_failed", error=config_problem(exc.key, exc.reason))
        return EXIT_CRASH
    except OSError as exc:
        log.error("supervisor.start_failed", error=str(exc))
        return EXIT_CRASH
