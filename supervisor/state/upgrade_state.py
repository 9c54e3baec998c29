"""What the upgrade gate decides on from durable state: a value, no I/O.

Apart from the store (which reads it, `StateStore.upgrade_state`) so that the gate, a pure
decision, imports nothing of the database.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpgradeState"]


@dataclass(frozen=True, slots=True)
class UpgradeState:
    """The facts of checks 5-8 of docs/protocol.md §2.2, read in one transaction once the
    assertion is verified."""

    bound_session_id: str | None
    local_event_max: int
    fence_generation: int  # 0 = no upgrade accepted yet
    fence_attempt_id: str | None
    jti_seen: bool  # the assertion's jti is cached and not yet expired: a replay
