"""session.bootstrap's I/O, next to its decision (`binding.decide_binding`): persist a new
binding, build the readiness frame, and make a rejection terminal (docs/protocol.md §5.2, §5.4).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
from structlog.typing import FilteringBoundLogger

from sandbox_supervisor.protocol import PROTOCOL_VERSION
from sandbox_supervisor.protocol.bootstrap import BootstrapBody, bootstrap_digest
from sandbox_supervisor.protocol.fields import is_scope
from sandbox_supervisor.protocol.frames import RuntimeStateBody, RuntimeStateFrame
from sandbox_supervisor.daemon.ops.logs import safe_log
from sandbox_supervisor.daemon.ops.notify import SystemdNotifier
from sandbox_supervisor.daemon.session.binding import BindForbidden, BindRejected, decide_binding
from sandbox_supervisor.daemon.session.control import BindFailed, BindNotAllowed, BindOutcome, BindRefused, Bound
from sandbox_supervisor.daemon.state.store import AlreadyBound, StateSnapshot, StateStore, StoreError
from sandbox_supervisor.daemon.status import EXIT_TERMINATED, DaemonStatus, Lifecycle

log = structlog.get_logger("supervisor")

STAGE_PERSISTED = "bootstrap-persisted"
STAGE_READINESS_SENT = "bootstrap-readiness-sent"


@dataclass(frozen=True, slots=True)
class BindingRules:
    workspace_root: Path
    allowed_profiles: Sequence[str]


def elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)


def log_stage(stage: str, outcome: str, duration_ms: float, session_id: str) -> None:
    """The startup-stage facts a platform's boot timeline reads (docs/protocol.md §5.2)."""
    safe_log(log, "sandbox.startup-stage", stage=stage, outcome=outcome, duration=duration_ms, sessionId=session_id)


def bind(
    body: BootstrapBody,
    store: StateStore,
    status: DaemonStatus,
    rules: BindingRules,
    socket_log: FilteringBoundLogger,
    *,
    may_bind: bool = True,
) -> BindOutcome:
    """Decide a bootstrap against the binding and persist a new one (before any answer).
    `socket_log` carries the socket's ids, so a failure names the session it cost."""
    digest = bootstrap_digest(body)
    try:
        binding = store.binding()
    except StoreError:
        socket_log.exception("bootstrap.state_unavailable")
        return BindFailed()
    decision = decide_binding(
        body,
        digest,
        binding.digest if binding else None,
        workspace_root=str(rules.workspace_root),
        allowed_profiles=rules.allowed_profiles,
        may_bind=may_bind,
    )
    if isinstance(decision, BindForbidden):
        socket_log.warning("bootstrap.forbidden", bound=binding is not None)
        return BindNotAllowed()
    if isinstance(decision, BindRejected):
        return BindRefused(decision.code, decision.message)
    started = time.monotonic()
    if decision.newly_bound:
        try:
            store.bind(body.sessionId, digest, body.model_dump_json(), time.time())
        except (StoreError, AlreadyBound):
            # AlreadyBound cannot happen on the one trio thread (the binding was read just
            # above); were it to, answering from a binding we did not re-read would be wrong.
            socket_log.exception("bootstrap.state_unavailable")
            log_stage(STAGE_PERSISTED, "failure", elapsed_ms(started), body.sessionId)
            return BindFailed()
        status.session = body
    # The success line is the socket's to write, after runtime.state is on its way: the
    # client waits for runtime.state, not for the log (the order of the lines is kept).
    return Bound(body, decision.newly_bound, persist_ms=elapsed_ms(started))


def readiness_frame(
    body: BootstrapBody,
    *,
    generation: int,
    event_ack: int,
    snapshot: StateSnapshot,
    version: str,
    scopes: Iterable[str],
) -> RuntimeStateFrame:
    return RuntimeStateFrame(
        body=RuntimeStateBody(
            status="ready",
            sessionId=body.sessionId,
            generation=generation,
            ackFloor=max(snapshot.ack_floor, event_ack),
            localEventMax=snapshot.local_event_max,
            oldestRetainedSeq=snapshot.oldest_retained_seq,
            supervisorVersion=version,
            protocolVersion=PROTOCOL_VERSION,
            scopes=[scope for scope in sorted(scopes) if is_scope(scope)],  # all are: the gate checked
        )
    )


def terminate(store: StateStore, status: DaemonStatus, notifier: SystemdNotifier, code: str, message: str) -> None:
    """A bootstrap was rejected: refuse everything from now on, durably, and exit 78."""
    try:
        store.mark_terminated(code, message, time.time())
    except StoreError:
        log.exception("terminate.persist_failed")
    status.lifecycle = Lifecycle.TERMINATED
    notifier.notify("STOPPING=1", "STATUS=terminated after a bootstrap rejection")
    log.warning("supervisor.terminated", code=code)
    status.request_stop(EXIT_TERMINATED, "terminated")
