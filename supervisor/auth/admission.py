"""The upgrade gate's I/O: read the state, decide (`gate.decide_upgrade`), record an admitted
attempt before its 101, and log the outcome (docs/protocol.md §2).

The decision is the pure `gate` module; this is the thin part that touches the store, the key
ring and the sandbox id file. Admit and record run without an await in between, so the
decide-and-record pair is atomic on the trio thread.
"""

from __future__ import annotations

import dataclasses
import os
import time

import structlog

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.authority import (
    AssertionClaims,
    AuthorityError,
    JwksError,
    VerifierSettings,
    verify_assertion,
)
from sandbox_supervisor.protocol.headers import RoutingHeaders
from sandbox_supervisor.daemon.auth.gate import Admit, Refuse, attempt_ids, decide_upgrade, refuse
from sandbox_supervisor.daemon.auth.identity import SandboxIdentity
from sandbox_supervisor.daemon.auth.keyring import KeyRing
from sandbox_supervisor.daemon.edge.http_front import RequestHead
from sandbox_supervisor.daemon.ops.logs import safe_log
from sandbox_supervisor.daemon.state.store import FenceRegressed, JtiReplayed, StateStore, StoreError, StoreFull
from sandbox_supervisor.daemon.status import DaemonStatus
from sandbox_supervisor.daemon.telemetry import UPGRADE_ACCEPTED, Telemetry

log = structlog.get_logger("supervisor")

# After an upgrade was refused `storage_full`, readiness reports the state full until the
# state's file system has at least this much more free space than it had then (or an upgrade
# is recorded): the next attempt would fail the same way, and a probe must not say "ready" to
# a control plane that connects on it, nor stay "not ready" once an operator freed space.
SPACE_FREED_BYTES = 256 * 1024


def free_bytes(path: os.PathLike[str] | str) -> int | None:
    """Bytes an unprivileged writer may still use on path's file system (None: unreadable)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


class UpgradeAdmission:
    def __init__(
        self,
        *,
        store: StateStore,
        keyring: KeyRing,
        identity: SandboxIdentity,
        status: DaemonStatus,
        verifier: VerifierSettings,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._keyring = keyring
        self._identity = identity
        self._status = status
        self._verifier = verifier
        self._telemetry = telemetry
        # Free bytes of the state's file system when the last upgrade failed for space; None
        # once an upgrade was recorded since (see SPACE_FREED_BYTES).
        self._full_at_free: int | None = None

    @property
    def storage_full(self) -> bool:
        """Whether an upgrade would be refused `storage_full` now, as far as the last attempt
        and the file system's free space tell (readiness's state check)."""
        if self._full_at_free is None:
            return False
        now = free_bytes(self._store.path.parent)
        return now is None or now < self._full_at_free + SPACE_FREED_BYTES

    def admit(self, head: RequestHead) -> Admit | Refuse:
        now = time.time()
        decision: Admit | Refuse
        try:
            decision = decide_upgrade(
                head.headers,
                self._status.lifecycle,
                local_sandbox_id=self._identity.read,
                verify=lambda headers: self._verify(headers, now),
                read_state=lambda jti: self._store.upgrade_state(jti, now),
            )
            if isinstance(decision, Admit):
                decision = self._record(decision, now)
                if isinstance(decision, Admit):
                    self._full_at_free = None
        except StoreFull as exc:
            # A passing fault: the client is told when to come back (Retry-After), not that
            # something broke. The fence was not recorded, so nothing was admitted.
            decision = refuse(errors.STORAGE_FULL, f"store: {exc}")
            self._full_at_free = free_bytes(self._store.path.parent) or 0
        except StoreError as exc:
            decision = refuse(errors.STATE_UNAVAILABLE, f"store: {type(exc).__name__}")
        self._report(decision)
        return decision

    def _record(self, admit: Admit, now: float) -> Admit | Refuse:
        """Fence and jti in one transaction, before the 101: an admitted attempt is durable
        even if the daemon dies during the handshake. The store re-checks both rules inside
        the transaction; its refusals are the peer's doing, answered as the gate would."""
        try:
            self._store.record_upgrade(
                generation=admit.headers.generation,
                attempt_id=admit.headers.attempt_id,
                jti=admit.claims.jti,
                jti_expires_at=admit.claims.exp + self._verifier.leeway_s,
                now=now,
            )
        except JtiReplayed:
            return refuse(errors.INVALID_AUTHORITY, "jti replayed", admit.headers)
        except FenceRegressed:
            return refuse(errors.STALE_GENERATION, "fence moved before the record", admit.headers)
        self._status.fence_generation = admit.headers.generation
        self._status.admissions += 1
        return dataclasses.replace(admit, admission=self._status.admissions)

    def _verify(self, headers: RoutingHeaders, now: float) -> AssertionClaims:
        try:
            keys = self._keyring.current()
        except (OSError, JwksError) as exc:  # a broken key file is an auth failure, not a crash
            raise AuthorityError("keys_unavailable") from exc
        return verify_assertion(headers.authority or "", keys, self._verifier, headers, now)

    def _report(self, decision: Admit | Refuse) -> None:
        if self._telemetry is not None:
            self._telemetry.upgrade(UPGRADE_ACCEPTED if isinstance(decision, Admit) else decision.code)
        if isinstance(decision, Admit):
            return  # its line is `log_accepted`'s, once its 101 is out: the client waits for the 101
        safe_log(
            log,
            "upgrade.rejected",
            error=decision.code,
            status=decision.status,
            detail=decision.detail,
            **attempt_ids(decision.headers),
        )


def log_accepted(admit: Admit) -> None:
    """The line of an admitted upgrade, written after its 101 (the refusals' are written by
    `UpgradeAdmission` before theirs)."""
    safe_log(log, "upgrade.accepted", **attempt_ids(admit.headers))
