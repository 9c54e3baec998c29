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
HTTP_OK = 200
HTTP_UNAVAILABLE = 503


def health_response(status: DaemonStatus) -> tuple[int, bytes]:
    """200 while serving, 503 otherwise; the body says which, the version, whether a session
    is bound, the uptime in whole seconds, whether commands run as their own user, and how
    they are isolated (the cgroup mode and the per-command limits it enforces, null: none)."""
    isolation = status.isolation
    body = {
        "status": HEALTH_STATUS[status.lifecycle],
        "version": status.version,
        "bound": status.session is not None,
        "uptimeS": int(time.monotonic() - status.started_monotonic),
        "privilegeSeparation": status.privilege_separation,
        "isolation": {
            "mode": isolation.get("mode"),
            "memoryMax": isolation.get("memory_max"),
            "pidsMax": isolation.get("pids_max"),
        },
    }
    return (HTTP_OK if status.serving else HTTP_UNAVAILABLE), json_body(body)
