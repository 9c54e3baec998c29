"""What the parts of one daemon share while it runs: its lifecycle, the session it is bound
to, the fenced generation, and the request to stop.

Plain state with one owner per field: the gate's admission writes the fence, a bootstrap
writes the session, the lifecycle moves SERVING → DRAINING or TERMINATED and never back.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from sandbox_supervisor.protocol.bootstrap import BootstrapBody

from sandbox_supervisor.daemon.exits import EXIT_CONFIG, EXIT_CRASH, EXIT_OK, EXIT_RESTART, EXIT_TERMINATED

__all__ = ["EXIT_CONFIG", "EXIT_CRASH", "EXIT_OK", "EXIT_RESTART", "EXIT_TERMINATED", "DaemonStatus", "Lifecycle", "StopRequest"]


class Lifecycle(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    TERMINATED = "terminated"


@dataclass(frozen=True, slots=True)
class StopRequest:
    exit_code: int
    reason: str


class DaemonStatus:
    def __init__(
        self,
        *,
        version: str,
        session: BootstrapBody | None,
        fence_generation: int,
        privilege_separation: bool = False,
        isolation: Mapping[str, object] | None = None,
    ) -> None:
        self.version = version
        # How commands are isolated (runtime/cgroups.py: the mode and the limits enforced),
        # as detected at start; /healthz reports it.
        self.isolation: Mapping[str, object] = isolation if isolation is not None else {"mode": "process-group"}
        # Commands run as their own user (`[exec] user`, and the daemon could switch to it);
        # /healthz reports it, so a separation that silently did not happen is visible.
        self.privilege_separation = privilege_separation
        self.lifecycle = Lifecycle.SERVING
        # Told when a bootstrap binds the session (the runtime opens agent.cwd for its jail
        # then); set by the app, None until it is.
        self.on_bound: Callable[[BootstrapBody], None] | None = None
        self._session = session
        # The daemon is the fence's only writer, so the fenced generation is kept here too:
        # every frame is checked against it, and a sqlite read per frame would be waste.
        self.fence_generation = fence_generation
        # Order of admission (the fence's order), see gate.Admit.admission.
        self.admissions = 0
        self.started_monotonic = time.monotonic()
        self.stop: StopRequest | None = None
        self.stop_requested = trio.Event()

    @property
    def session(self) -> BootstrapBody | None:
        return self._session

    @session.setter
    def session(self, body: BootstrapBody | None) -> None:
        self._session = body
        if body is not None and self.on_bound is not None:
            self.on_bound(body)

    @property
    def serving(self) -> bool:
        return self.lifecycle is Lifecycle.SERVING

    def request_stop(self, exit_code: int, reason: str) -> None:
        """The first request wins: a stop after a termination keeps exit status 78."""
        if self.stop is None:
            self.stop = StopRequest(exit_code, reason)
            self.stop_requested.set()
