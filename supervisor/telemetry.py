"""What the daemon's parts report to metrics, as one narrow interface.

`ops.metrics.SupervisorMetrics` implements it when metrics are enabled; otherwise the parts
hold None and skip the call (one attribute check on the hot paths). Best effort: a report
never changes behaviour.
"""

from __future__ import annotations

from typing import Protocol

# The `upgrade` outcome of an admitted upgrade (refusals report their error code).
UPGRADE_ACCEPTED = "accepted"


class Telemetry(Protocol):
    def upgrade(self, outcome: str) -> None: ...

    def tool_call(self, tool: str, outcome: str, duration_s: float | None = None) -> None:
        """A tool.result journaled; `duration_s`: the tool's run time (None for a refusal
        that ran nothing)."""

    def process_started(self) -> None: ...

    def process_exited(self) -> None: ...

    def events_replayed(self, count: int) -> None: ...

    def output_spooled(self, nbytes: int) -> None: ...
