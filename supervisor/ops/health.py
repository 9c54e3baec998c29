"""GET /healthz (liveness: the daemon's lifecycle as a status and a small JSON body) and
GET /readyz (readiness: whether an upgrade could be admitted now); docs/operations.md."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sandbox_supervisor.daemon.auth.identity import SandboxIdentity
from sandbox_supervisor.daemon.auth.keyring import KeyRing
from sandbox_supervisor.daemon.edge.http_front import json_body
from sandbox_supervisor.daemon.status import DaemonStatus, Lifecycle

HEALTH_STATUS = {
    Lifecycle.SERVING: "ok",
    Lifecycle.DRAINING: "draining",
    Lifecycle.TERMINATED: "terminated",
}
# Started on a full state directory, its state not opened yet (app.run_supervisor retries):
# health and refusals are served, nothing else.
STORAGE_FULL_STATUS = "storage_full"
HTTP_OK = 200
HTTP_UNAVAILABLE = 503


def health_response(status: DaemonStatus, *, storage_full: bool = False) -> tuple[int, bytes]:
    """200 while serving, 503 otherwise; the body says which, the version, whether a session
    is bound, the uptime in whole seconds, whether commands run as their own user, and how
    they are isolated (the cgroup mode and the per-command limits it enforces, null: none).
    `storage_full`: the daemon waits for space to open its state (503 `storage_full`, and
    `bound` is null: the state that says it cannot be read yet)."""
    isolation = status.isolation
    body = {
        "status": STORAGE_FULL_STATUS if storage_full else HEALTH_STATUS[status.lifecycle],
        "version": status.version,
        "bound": None if storage_full else status.session is not None,
        "uptimeS": int(time.monotonic() - status.started_monotonic),
        "privilegeSeparation": status.privilege_separation,
        "isolation": {
            "mode": isolation.get("mode"),
            "memoryMax": isolation.get("memory_max"),
            "pidsMax": isolation.get("pids_max"),
        },
    }
    return (HTTP_OK if status.serving and not storage_full else HTTP_UNAVAILABLE), json_body(body)


# --- readiness (GET /readyz) --------------------------------------------------------------
#
# Liveness says the process answers; readiness says an upgrade could succeed now. They
# differ while the sandbox id is not readable yet (every upgrade is refused 503 meanwhile),
# while the state waits for disk space, and once the daemon drains or is terminated.

READY_STATUS = "ready"
NOT_READY_STATUS = "not_ready"
CHECK_OK = "ok"
# The keys check's problem: no trusted key (never true of a running daemon today: a JWKS
# without keys is refused at start and on reload; checked so readiness never assumes it).
KEYS_NONE = "no_keys"


@dataclass(frozen=True, slots=True)
class Readiness:
    """What /readyz checks, each "ok" or a stable word saying what is wrong, and a sentence
    for each problem."""

    checks: dict[str, str]
    detail: dict[str, str]

    @property
    def ready(self) -> bool:
        return all(value == CHECK_OK for value in self.checks.values())


def readiness(
    status: DaemonStatus, identity: SandboxIdentity, keyring: KeyRing, *, storage_full: bool = False
) -> Readiness:
    """The three things an upgrade needs: the state opened and serving, a trusted key, and
    the local sandbox id (docs/operations.md, "Health and readiness")."""
    checks: dict[str, str] = {}
    detail: dict[str, str] = {}
    if storage_full:
        checks["state"] = STORAGE_FULL_STATUS
        detail["state"] = "the state directory is full: upgrades are refused until space is freed"
    elif not status.serving:
        checks["state"] = HEALTH_STATUS[status.lifecycle]
        detail["state"] = f"the daemon is {HEALTH_STATUS[status.lifecycle]}"
    else:
        checks["state"] = CHECK_OK
    try:
        keys = len(keyring.current())
    except Exception:  # noqa: BLE001 - a probe must answer, whatever the key file does
        keys = 0
    if keys:
        checks["keys"] = CHECK_OK
    else:
        checks["keys"] = KEYS_NONE
        detail["keys"] = f"no trusted key in {keyring.path}"
    sandbox = identity.status()
    if sandbox.problem is None:
        checks["sandboxId"] = CHECK_OK
    else:
        checks["sandboxId"] = sandbox.problem
        detail["sandboxId"] = sandbox.detail
    return Readiness(checks, detail)


def readiness_response(ready: Readiness) -> tuple[int, bytes]:
    """200 `{"status":"ready","checks":{…}}` when every check is ok; else 503 with
    `"status":"not_ready"` and `detail` naming each problem."""
    body: dict[str, object] = {
        "status": READY_STATUS if ready.ready else NOT_READY_STATUS,
        "checks": ready.checks,
    }
    if not ready.ready:
        body["detail"] = ready.detail
    return (HTTP_OK if ready.ready else HTTP_UNAVAILABLE), json_body(body)
