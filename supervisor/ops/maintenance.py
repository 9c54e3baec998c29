"""Keeping the state directory small while the daemon runs: free pages go back to the file
system after pruning (docs/operations.md, "Disk use of the state directory")."""

from __future__ import annotations

import structlog
import trio

from sandbox_supervisor.daemon.state.store import VACUUM_STEP_PAGES, StateStore, StoreError

log = structlog.get_logger("supervisor")

# How often the free pages are looked at: acks prune continuously, and a second's worth of
# freed pages is given back at once.
VACUUM_INTERVAL_S = 1.0
# Below this many free pages (4 MiB) nothing is done: pages freed by one ack are reused by the
# next events anyway, and a give-back costs a WAL write of each page it moves.
VACUUM_MIN_FREE_PAGES = 1024


async def give_space_back(store: StateStore, interval_s: float = VACUUM_INTERVAL_S) -> None:
    """Every `interval_s`, when enough pages are free, give them back in steps of
    VACUUM_STEP_PAGES with a checkpoint of the loop between steps (other tasks run in
    between: the loop never stalls for more than one step), then checkpoint the WAL so the
    file itself shrinks. A failure (a full disk) is logged once per streak, and tried again."""
    failing = False
    while True:
        await trio.sleep(interval_s)
        try:
            free = store.free_pages()
            if free < VACUUM_MIN_FREE_PAGES:
                continue
            before = free
            while free > 0:
                left = store.give_back_pages(VACUUM_STEP_PAGES)
                if left >= free:
                    break
                free = left
                await trio.sleep(0)
            if free == before:
                # Nothing moved: the database has no incremental auto-vacuum (its conversion
                # at start failed, logged as state.vacuum_failed). The next start tries again.
                return
            store.checkpoint()
        except StoreError as exc:
            if not failing:
                log.warning("state.vacuum_failed", error=str(exc))
            failing = True
            continue
        failing = False
        log.info("state.space_given_back", pages=before - free)
