"""GET /healthz: the daemon's lifecycle as a status and a small JSON body (docs/operations.md)."""

from __future__ import annotations

import time

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
