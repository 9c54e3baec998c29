"""The fence rule of docs/protocol.md §4, defined once: the gate decides with it and the store
re-checks it inside the transaction that moves the fence."""

from __future__ import annotations


def fence_admits(generation: int, attempt_id: str, fence_generation: int, fence_attempt: str | None) -> bool:
    """A higher generation, or a retry of exactly the fenced attempt (fence_generation 0: no
    upgrade was ever admitted)."""
    if generation > fence_generation:
        return True
    return generation == fence_generation and attempt_id == fence_attempt
