"""The daemon assembled: state, keys, identity, listeners, and the life of each control socket.

`run_supervisor` is the one place that owns the daemon's tasks (a nursery for the listeners,
one for signals); `Supervisor` holds the state the connections share and implements the
`ConnectionApp` the server front calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import structlog
import trio
import trio_websocket

from sandbox_supervisor.protocol import PROTOCOL_VERSION, errors
from sandbox_supervisor.protocol.authority import AuthorityError, JwksError, VerifierSettings, verify_assertion
from sandbox_supervisor.protocol.bootstrap import BootstrapBody, bootstrap_digest
from sandbox_supervisor.protocol.frames import (
    BootstrapRejectedFrame,
    ExecOutputPageFrame,
    ExecSignalFrame,
    FrameError,
    RuntimeStateFrame,
    SessionBootstrapFrame,
    decode_client_frame,
    encode_frame,
)
from sandbox_supervisor.daemon.edge import http_front
from sandbox_supervisor.protocol import closes as sessions
from sandbox_supervisor.daemon.session.binding import BindRejected, decide_binding
from sandbox_supervisor.daemon.config import SupervisorConfig
from sandbox_supervisor.daemon.auth.gate import Admit, GateState, Lifecycle, Refuse, decide_upgrade, refuse
from sandbox_supervisor.daemon.auth.identity import SandboxIdentity
from sandbox_supervisor.daemon.auth.keyring import KeyRing
from sandbox_supervisor.daemon.ops.logs import configure_logging, safe_log
from sandbox_supervisor.daemon.edge.activation import ActivationError, open_daemon_listeners
from sandbox_supervisor.daemon.ops.notify import SystemdNotifier, send_watchdog_pings, watchdog_interval_s
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.runtime.calls import CallRunner, error_frame
from sandbox_supervisor.daemon.runtime.handler import RuntimeHandler
from sandbox_supervisor.daemon.runtime.recovery import recover_pending_calls
from sandbox_supervisor.daemon.session.sender import SocketSender
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime, ShellSettings
from sandbox_supervisor.daemon.edge.server import BoundListeners, remove_unix_paths, serve
from sandbox_supervisor.daemon.session.hub import Connection, SessionHub
from sandbox_supervisor.daemon.state.store import StateStore, StoreError

log = structlog.get_logger("supervisor")

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_TERMINATED = 78  # the unit's RestartPreventExitStatus: a terminated sandbox stays down

LISTENING_FILE = "listening.json"
CLOSE_HANDSHAKE_TIMEOUT_S = 1.0
# After the process groups are gone, how long the stop waits for their calls to journal
# exec.completed + tool.result (the completion grace is 200 ms).
STOP_COMPLETION_BUDGET_S = 1.0


def supervisor_version() -> str:
    try:
        return metadata.version("sandbox-supervisor")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class StartupError(Exception):
    """The daemon cannot start with this configuration (exit 2)."""


@dataclass(slots=True)
class StopRequest:
    exit_code: int
    reason: str


class Supervisor:
    """Shared state of one daemon and the handling of its control sockets."""

    def __init__(
        self,
        config: SupervisorConfig,
        store: StateStore,
        keyring: KeyRing,
        identity: SandboxIdentity,
        notifier: SystemdNotifier,
    ) -> None:
        self.config = config
        self.store = store
        self.keyring = keyring
        self.identity = identity
        self.notifier = notifier
        self.version = supervisor_version()
        self.hub = SessionHub()
        self.journal = Journal(store)
        self.calls: CallRunner | None = None  # set once the daemon's call nursery is open
        self.shell: ShellRuntime | None = None  # likewise
        binding = store.binding()
        self.session = BootstrapBody.model_validate_json(binding.body_json) if binding else None
        # A terminated state dir never gets this far: run_supervisor exits 78 first.
        self.lifecycle = Lifecycle.SERVING
        self.started_monotonic = time.monotonic()
        self.admissions = 0
        # The daemon is the fence's only writer, so the fenced generation is kept here too:
        # every frame is checked against it, and a sqlite read per frame would be waste.
        self.fence_generation = store.snapshot().fence_generation
        self.stop_requested = trio.Event()
        self.stop: StopRequest | None = None
        ws = config.websocket
        self.route_paths = http_front.RoutePaths(
            control=ws.control_path,
            health=ws.health_path,
            metrics=ws.metrics_path if ws.metrics_enabled else None,
        )
        # Named telemetry, not metrics: `metrics()` is the route. None while disabled, so the
        # hot paths pay one attribute check.
        self.telemetry = None
        if ws.metrics_enabled:
            # Imported only when enabled: prometheus_client costs ~2 MiB of an idle daemon.
            from sandbox_supervisor.daemon.ops import metrics

            self.telemetry = metrics.SupervisorMetrics()
            self.accepted_label = metrics.UPGRADE_ACCEPTED
            # Read at scrape time from what the journal already keeps: no query per scrape.
            journal = self.journal
            self.telemetry.observe_journal(lambda: journal.last_seq, lambda: journal.pruned_through)
        self.handshake_timeout_s = ws.handshake_timeout_s
        self.max_message_bytes = ws.max_message_bytes
        self.verifier_settings = VerifierSettings(
            issuer=config.authority.issuer,
            audience=config.authority.audience,
            leeway_s=config.authority.leeway_s,
            max_lifetime_s=config.authority.max_lifetime_s,
        )

    # --- lifecycle ---------------------------------------------------------------------

    def request_stop(self, exit_code: int, reason: str) -> None:
        if self.stop is None:
            self.stop = StopRequest(exit_code, reason)
            self.stop_requested.set()

    def holds_fence(self, conn: Connection) -> bool:
        """The socket is the authoritative one and its generation is the fenced one: only
        then may its frames act (docs/protocol.md §4.3). A newer upgrade that passed the gate moves the
        fence even when its handshake fails and supersedes nobody."""
        return self.hub.is_authoritative(conn) and conn.generation == self.fence_generation

    def terminate(self, code: str, message: str) -> None:
        """A bootstrap was rejected: refuse everything from now on, durably, and exit 78."""
        try:
            self.store.mark_terminated(code, message, time.time())
        except StoreError:
            log.exception("terminate.persist_failed")
        self.lifecycle = Lifecycle.TERMINATED
        self.notifier.notify("STOPPING=1", "STATUS=terminated after a bootstrap rejection")
        log.warning("supervisor.terminated", code=code)
        self.request_stop(EXIT_TERMINATED, "terminated")

    # --- plain HTTP --------------------------------------------------------------------

    def health(self) -> tuple[int, bytes]:
        status = {
            Lifecycle.SERVING: "ok",
            Lifecycle.DRAINING: "draining",
            Lifecycle.TERMINATED: "terminated",
        }[self.lifecycle]
        body = {
            "status": status,
            "version": self.version,
            "bound": self.session is not None,
            "uptimeS": int(time.monotonic() - self.started_monotonic),
        }
        return (200 if self.lifecycle is Lifecycle.SERVING else 503), http_front.json_body(body)

    async def exec_frame(self, frame, reply) -> None:
        """exec.signal and exec.read_output (docs/protocol.md §7.4.6, §7.4.7)."""
        body = frame.body
        if isinstance(frame, ExecSignalFrame):
            code = self.shell.signal_command(body.call_id, body.signal)
            if code is not None:
                message = "No such command call." if code == errors.UNKNOWN_CALL else "The command has finished."
                await reply(error_frame(code, message, body.call_id))
            return
        page = self.shell.read_output(body.call_id, body.stream, body.offset, body.length)
        if page is None:
            await reply(error_frame(errors.UNKNOWN_CALL, "No such command call.", body.call_id))
            return
        await reply(encode_frame(ExecOutputPageFrame.model_validate({"kind": "exec.output_page", "body": page})))

    def metrics(self) -> tuple[int, bytes]:
        assert self.telemetry is not None  # the route exists only while metrics are enabled
        return 200, self.telemetry.render()

    # --- the gate ----------------------------------------------------------------------

    def admit_upgrade(self, head: http_front.RequestHead) -> Admit | Refuse:
        now = time.time()
        try:
            snapshot = self.store.snapshot()
            decision = decide_upgrade(
                head.headers,
                GateState(
                    lifecycle=self.lifecycle,
                    bound_session_id=snapshot.bound_session_id,
                    local_event_max=snapshot.local_event_max,
                    fence_generation=snapshot.fence_generation,
                    fence_attempt_id=snapshot.fence_attempt_id,
                ),
                local_sandbox_id=self.identity.read,
                verify=lambda headers: self._verify(headers, now),
                jti_seen=lambda jti: self.store.jti_seen(jti, now),
            )
            if isinstance(decision, Admit):
                # Fence and jti in one transaction, before the 101: an admitted attempt is
                # durable even if the daemon dies during the handshake.
                self.store.record_upgrade(
                    generation=decision.headers.generation,
                    attempt_id=decision.headers.attempt_id,
                    jti=decision.claims.jti,
                    jti_expires_at=decision.claims.exp + self.verifier_settings.leeway_s,
                    now=now,
                )
                self.fence_generation = decision.headers.generation
                self.admissions += 1
                decision = dataclasses.replace(decision, admission=self.admissions)
        except StoreError as exc:
            decision = refuse(errors.STATE_UNAVAILABLE, f"store: {type(exc).__name__}")
        self._log_decision(decision)
        return decision

    def _verify(self, headers, now: float):
        try:
            keys = self.keyring.current()
        except Exception as exc:  # noqa: BLE001 - a broken key file is an auth failure, not a crash
            raise AuthorityError("keys_unavailable") from exc
        return verify_assertion(headers.authority or "", keys, self.verifier_settings, headers, now)

    def _log_decision(self, decision: Admit | Refuse) -> None:
        headers = decision.headers
        ids = (
            {
                "session_id": headers.session_id,
                "generation": headers.generation,
                "attempt_id": headers.attempt_id,
            }
            if headers is not None
            else {}
        )
        if self.telemetry is not None:
            self.telemetry.upgrade(self.accepted_label if isinstance(decision, Admit) else decision.code)
        if isinstance(decision, Admit):
            safe_log(log, "upgrade.accepted", **ids)
        else:
            safe_log(
                log,
                "upgrade.rejected",
                error=decision.code,
                status=decision.status,
                detail=decision.detail,
                **ids,
            )

    # --- a control socket --------------------------------------------------------------

    async def run_socket(self, ws: trio_websocket.WebSocketConnection, admit: Admit) -> None:
        conn = Connection(
            ws, admit.headers, admit.claims, admission=admit.admission, last_inbound=trio.current_time()
        )
        self.hub.admit(conn)
        bound_log = log.bind(
            session_id=conn.headers.session_id,
            generation=conn.generation,
            attempt_id=conn.headers.attempt_id,
        )
        if self.lifecycle is not Lifecycle.SERVING:
            # Admitted, then the daemon started stopping before the 101 went out.
            conn.request_close(sessions.CLOSE_GOING_AWAY, sessions.STOPPING_REASON)
        try:
            with conn.cancel_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._keepalive, conn)
                    await self._converse(conn, bound_log)
                    nursery.cancel_scope.cancel()
        except Exception:
            bound_log.exception("socket.crashed")
            conn.close_request = conn.close_request or (
                sessions.CLOSE_INTERNAL_ERROR,
                sessions.INTERNAL_REASON,
            )
        finally:
            code, reason = conn.close_request or (sessions.CLOSE_NORMAL, "")
            # While stopping, the close handshake gets only the drain budget.
            timeout = (
                CLOSE_HANDSHAKE_TIMEOUT_S
                if self.lifecycle is Lifecycle.SERVING
                else self.config.websocket.drain_budget_s
            )
            with trio.move_on_after(timeout) as scope:
                scope.shield = True
                try:
                    await ws.aclose(code, reason)
                except Exception:  # noqa: BLE001 - the peer may already be gone
                    pass
            # Forgotten only once closed, so a drain waiting for all sockets waits for this.
            self.hub.forget(conn)
            if conn.close_request is None and ws.closed is not None:
                # Closed before we asked: by the peer, or by the WebSocket library itself (1009
                # for a message over its limit). Log that close, not the default we sent.
                code, reason = ws.closed.code, ws.closed.reason or ""
            bound_log.info("socket.closed", code=code, reason=reason)

    async def _keepalive(self, conn: Connection) -> None:
        """Ping after `ping_interval_s` of inbound silence; close after `idle_timeout_s`.

        A pong counts as inbound traffic, so a live peer is never closed for idleness.
        """
        ping_interval = self.config.websocket.ping_interval_s
        idle_timeout = self.config.websocket.idle_timeout_s
        while True:
            idle_for = trio.current_time() - conn.last_inbound
            if idle_for >= idle_timeout:
                conn.request_close(sessions.CLOSE_INTERNAL_ERROR, sessions.IDLE_REASON)
                return
            if idle_for < ping_interval:
                await trio.sleep(ping_interval - idle_for)
                continue
            with trio.move_on_after(idle_timeout - idle_for):
                try:
                    await conn.ws.ping()
                except trio_websocket.ConnectionClosed:
                    return
                conn.last_inbound = trio.current_time()

    async def receive_text(self, conn: Connection) -> str | None:
        """The next text message, or None when the socket is done (closed, or a binary frame,
        which is answered with 1003)."""
        try:
            message = await conn.ws.get_message()
        except trio_websocket.ConnectionClosed:
            return None
        conn.last_inbound = trio.current_time()
        if isinstance(message, bytes):
            conn.request_close(sessions.CLOSE_UNSUPPORTED_DATA, sessions.BINARY_REASON)
            return None
        # trio-websocket measures a text message in characters; the limit is in bytes. Only
        # a message that could exceed it (up to 4 bytes a character) is encoded to count.
        if len(message) * 4 > self.max_message_bytes and len(message.encode("utf-8")) > self.max_message_bytes:
            conn.request_close(sessions.CLOSE_MESSAGE_TOO_BIG, sessions.TOO_BIG_REASON)
            return None
        return message

    async def send_text(self, conn: Connection, text: str) -> bool:
        try:
            await conn.ws.send_message(text)
            return True
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return False

    async def _converse(self, conn: Connection, bound_log) -> None:
        raw = await self.receive_text(conn)
        if raw is None:
            return
        try:
            frame = decode_client_frame(raw)
        except FrameError:
            frame = None
        if not isinstance(frame, SessionBootstrapFrame):
            conn.request_close(sessions.CLOSE_PROTOCOL_ERROR, sessions.EXPECTED_BOOTSTRAP_REASON)
            return
        if (
            frame.body.sessionId != conn.headers.session_id
            or frame.connectionGeneration != conn.generation
        ):
            conn.request_close(sessions.CLOSE_POLICY_VIOLATION, sessions.BOOTSTRAP_MISMATCH_REASON)
            return
        if not self.holds_fence(conn):
            # A newer upgrade passed the gate while this socket was silent (its own 101 may
            # never have completed, so nothing superseded this one yet): a fenced-out attempt
            # must not bind the session, nor terminate it with a mismatched body.
            conn.request_close(sessions.CLOSE_POLICY_VIOLATION, sessions.SUPERSEDED_REASON)
            return
        if not await self.handle_bootstrap(conn, frame, bound_log):
            return
        # Replay starts after the floor the client declared in its upgrade; the same cursor
        # then follows the journal live, so the seam cannot skip or repeat an event.
        sender = SocketSender(conn.ws, self.journal, cursor=conn.headers.event_ack, telemetry=self.telemetry)
        await RuntimeHandler(self, conn, bound_log, sender).run()

    async def handle_bootstrap(
        self, conn: Connection, frame: SessionBootstrapFrame, bound_log, reply=None
    ) -> bool:
        """Bind or re-attach (True: the socket carries on), or reject and terminate (False).

        `reply` queues through the socket's sender once it is attached; before that the
        readiness frame is sent directly, so a failure to send it can be acted on."""
        body = frame.body
        digest = bootstrap_digest(body)
        binding = self.store.binding()
        decision = decide_binding(
            body,
            digest,
            binding.digest if binding else None,
            workspace_root=str(self.config.paths.workspace_root),
            allowed_profiles=self.config.bootstrap.profiles,
        )
        if isinstance(decision, BindRejected):
            await self._reject_bootstrap(conn, decision, bound_log)
            return False

        started = time.monotonic()
        if decision.newly_bound:
            try:
                self.store.bind(body.sessionId, digest, body.model_dump_json(), time.time())
                self.session = body
            except StoreError:
                self._stage("bootstrap-persisted", "failure", started, body.sessionId)
                conn.request_close(sessions.CLOSE_INTERNAL_ERROR, sessions.INTERNAL_REASON)
                return False
        self._stage("bootstrap-persisted", "success", started, body.sessionId)

        started = time.monotonic()
        snapshot = self.store.snapshot()
        state = RuntimeStateFrame.model_validate(
            {
                "kind": "runtime.state",
                "body": {
                    "status": "ready",
                    "sessionId": body.sessionId,
                    "generation": conn.generation,
                    "ackFloor": max(snapshot.ack_floor, conn.headers.event_ack),
                    "localEventMax": snapshot.local_event_max,
                    "oldestRetainedSeq": snapshot.oldest_retained_seq,
                    "supervisorVersion": self.version,
                    "protocolVersion": PROTOCOL_VERSION,
                    "scopes": sorted(conn.claims.scopes),
                },
            }
        )
        if reply is not None:
            await reply(encode_frame(state))
        elif not await self.send_text(conn, encode_frame(state)):
            self._stage("bootstrap-readiness-sent", "failure", started, body.sessionId)
            conn.request_close(sessions.CLOSE_INTERNAL_ERROR, sessions.SEND_FAILED_REASON)
            return False
        self._stage("bootstrap-readiness-sent", "success", started, body.sessionId)
        bound_log.info("session.attached", newly_bound=decision.newly_bound)
        return True

    def _stage(self, stage: str, outcome: str, started: float, session_id: str) -> None:
        safe_log(
            log,
            "sandbox.startup-stage",
            stage=stage,
            outcome=outcome,
            duration=round((time.monotonic() - started) * 1000, 3),
            sessionId=session_id,
        )

    async def _reject_bootstrap(self, conn: Connection, decision: BindRejected, bound_log) -> None:
        """Send the rejection, wait for the receipt (4400), then terminate either way."""
        bound_log.warning("bootstrap.rejected", code=decision.code)
        frame = BootstrapRejectedFrame.model_validate(
            {"kind": "session.bootstrap.rejected", "body": {"code": decision.code, "message": decision.message}}
        )
        if not await self.send_text(conn, encode_frame(frame)):
            conn.request_close(sessions.CLOSE_INTERNAL_ERROR, sessions.SEND_FAILED_REASON)
            self.terminate(decision.code, decision.message)
            return
        receipt = False
        try:
            with trio.move_on_after(self.config.bootstrap.rejection_receipt_timeout_s):
                try:
                    while True:
                        await conn.ws.get_message()  # anything but the close is ignored now
                except trio_websocket.ConnectionClosed as exc:
                    receipt = (
                        exc.reason.code == sessions.CLOSE_REJECTION_RECEIPT
                        and exc.reason.reason == sessions.REJECTION_RECEIPT_REASON
                    )
                    # The peer closed: nothing left to send, whatever code it used.
                    conn.close_request = (exc.reason.code, exc.reason.reason or "")
            if conn.close_request is None:
                conn.request_close(sessions.CLOSE_INTERNAL_ERROR, sessions.RECEIPT_NOT_OBSERVED_REASON)
            bound_log.info("bootstrap.rejection_receipt", observed=receipt)
        finally:
            # Also when the wait is cut short (the socket superseded, the daemon stopping):
            # the rejection was decided, and it is terminal whatever happens to this socket.
            self.terminate(decision.code, decision.message)


# --- running the daemon ----------------------------------------------------------------


def write_listening_file(state_dir: Path, bound: BoundListeners) -> None:
    """Atomically publish the bound addresses (port 0 resolved) for scripts and tests."""
    path = state_dir / LISTENING_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tcp": bound.tcp, "unix": bound.unix}))
    os.replace(tmp, path)


async def _watch_signals(sup: Supervisor) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                sup.keyring.reload(reason="sighup")
            else:
                log.info("supervisor.signal", signal=signal.Signals(signum).name)
                sup.request_stop(EXIT_OK, signal.Signals(signum).name)


def open_state(config: SupervisorConfig) -> tuple[StateStore, KeyRing]:
    try:
        keyring = KeyRing(config.authority.jwks_file)
    except (OSError, JwksError) as exc:
        raise StartupError(f"authority.jwks_file: {exc}") from None
    try:
        store = StateStore.open(config.paths.state_dir)
    except (OSError, StoreError) as exc:
        raise StartupError(f"paths.state_dir: {exc}") from None
    return store, keyring


async def run_supervisor(
    config: SupervisorConfig,
    *,
    handle_signals: bool = True,
    env: MutableMapping[str, str] = os.environ,
    task_status=trio.TASK_STATUS_IGNORED,
) -> int:
    """Run until stopped; return the exit status. `task_status.started` gets the Supervisor
    and the bound listeners once the daemon is ready (what READY=1 means)."""
    notifier = SystemdNotifier(env)
    store, keyring = open_state(config)
    try:
        if store.snapshot().terminated is not None:
            log.error("supervisor.terminated_at_start")
            notifier.notify("STOPPING=1", "STATUS=terminated after a bootstrap rejection")
            return EXIT_TERMINATED
        # Calls a previous instance left pending are completed before anyone can connect, so
        # a reconnecting client finds exactly one result for each of them.
        recovered = recover_pending_calls(store, config.paths.state_dir)
        if recovered:
            log.warning("calls.recovered", count=recovered)
        identity = SandboxIdentity(config.paths.sandbox_id_file, env)
        sup = Supervisor(config, store, keyring, identity, notifier)
        try:
            bound, owned_unix = await open_daemon_listeners(config.listen.tcp, config.listen.unix, env)
        except ActivationError as exc:
            raise StartupError(str(exc)) from None
        try:
            write_listening_file(config.paths.state_dir, bound)
            async with trio.open_nursery() as nursery:
                # Tool calls belong to the session, not to a socket: they run here, outliving
                # the connection that asked for them.
                sup.calls = build_call_runner(sup, nursery)
                if handle_signals:
                    nursery.start_soon(_watch_signals, sup)
                await nursery.start(serve, bound.listeners, sup, config.websocket.max_handshakes)
                log.info("supervisor.ready", tcp=bound.tcp, unix=bound.unix, version=sup.version)
                notifier.notify("READY=1", "STATUS=serving")
                interval = watchdog_interval_s(env)
                if interval is not None:
                    # Runs on the trio loop: a wedged loop stops the pings, and systemd
                    # restarts the daemon, which is what the watchdog is for.
                    nursery.start_soon(send_watchdog_pings, notifier, interval)
                task_status.started((sup, bound))
                await sup.stop_requested.wait()
                await _drain(sup)
                nursery.cancel_scope.cancel()
        finally:
            # Only paths the daemon created: an inherited socket belongs to its socket unit.
            remove_unix_paths(owned_unix)
        assert sup.stop is not None
        log.info("supervisor.stopped", exit_code=sup.stop.exit_code, reason=sup.stop.reason)
        return sup.stop.exit_code
    finally:
        store.close()


def build_call_runner(sup: Supervisor, nursery: trio.Nursery) -> CallRunner:
    from sandbox_supervisor.daemon.runtime import file_tools

    runner = CallRunner(sup.store, sup.journal, nursery, telemetry=sup.telemetry)
    file_tools.register(runner)
    sup.shell = ShellRuntime(
        ShellSettings.from_config(sup.config), sup.store, sup.journal, nursery, telemetry=sup.telemetry
    )
    runner.register("execute_shell_command", sup.shell.execute)
    return runner


async def _drain(sup: Supervisor) -> None:
    """Refuse new upgrades; end running commands (SIGTERM, SIGKILL after the grace) so their
    completions are journaled; then close every socket with 1001 within the drain budget."""
    if sup.lifecycle is Lifecycle.SERVING:
        sup.lifecycle = Lifecycle.DRAINING
        sup.notifier.notify("STOPPING=1", "STATUS=draining")
    if sup.shell is not None:
        await sup.shell.stop_all()
        # The calls' own tasks journal exec.completed and tool.result once the shells
        # have exited; give them a moment beyond the completion grace.
        with trio.move_on_after(STOP_COMPLETION_BUDGET_S):
            await sup.shell.wait_calls_completed()
    sup.hub.close_all(sessions.CLOSE_GOING_AWAY, sessions.STOPPING_REASON)
    with trio.move_on_after(sup.config.websocket.drain_budget_s):
        await sup.hub.wait_all_closed()


def serve_main(config: SupervisorConfig) -> int:
    """Entry point of `sandbox-supervisor serve`."""
    configure_logging(config.logging.level, config.logging.format)
    try:
        return trio.run(run_supervisor, config)
    except StartupError as exc:
        log.error("supervisor.bad_configuration", problem=str(exc))
        return EXIT_CONFIG
    except OSError as exc:
        log.error("supervisor.start_failed", error=str(exc))
        return EXIT_CRASH
