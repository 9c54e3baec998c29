"""Command cgroups made ahead of need, offered to the command host's idle shells, and
removed behind their commands.

A command's cgroup costs its call two things: making it (a mkdir in each hierarchy and the
limits' writes, 0.3 ms on the benchmark machine) and moving the command's first process into
it. The move is the dear one: the kernel orders migrations against every fork and exit with
a lock whose writer waits for an RCU grace period unless another migration ran a moment
before, so after an agent's pause a move takes 10-15 ms on a stock kernel (docs/operations.md,
"Process isolation"). Both can be paid between calls:

- The shell runtime keeps a few cgroups made ahead (`ready-<hex>` beside the per-call ones,
  limits set), made by a worker thread, and a command takes one instead of making its own;
  so does a held process's start (process_host.py), never one on offer. When none is ready
  (the first command, a burst, a refusal) the command makes its cgroup, named after its
  call_id, as before.
- A command the host's pool can run (`command_host.pool_key`) takes one of the cgroups
  offered to the host: each spawn request offers the host cgroups to put its next idle
  shells into (`place`), so the shell that runs the command is already a member when the
  call arrives, and nothing moves on the call's path. Another command never takes an offered
  cgroup, which may hold an idle shell; the host ends one it finds in a fresh spawn's cgroup.

A finished command's cgroup is removed behind it too (`retire`), by a worker thread, after its
call's result is journaled, with the others queued by then (a burst's, or in a refill's hop).
An rmdir of a cgroup waits for the kernel to take the group offline: 30-80 µs mostly, but
3.5 ms at the 90th percentile and up to 20 ms on the benchmark machine, which the event loop
(and often the call's result) waited for before.

A cgroup so named says nothing about its call: the process record keeps its name
(`StateStore.start_process`, and a held process's `start_held`), and a restart adopts,
signals and keeps a command's or a held process's cgroup by it. Those a previous run left
ready, and those offered and never used, are leftovers to the next start: empty, or holding
an idle shell that has run nothing, and removed with the rest.
"""

from __future__ import annotations

import os
import uuid

import structlog
import trio

from sandbox_supervisor.daemon.runtime.cgroups import Cgroups, CommandCgroup

__all__ = ["READY_PREFIX", "ReadyCgroups", "remove_all"]

log = structlog.get_logger("supervisor.cgroups")

# The name of a cgroup made ahead: a call_id is a UUID, so the two never meet.
READY_PREFIX = "ready-"
# How many are kept ready beside those on offer, and below how many the worker makes more.
READY_TARGET = 4
READY_LOW = 2
# After a refusal (a hierarchy's descendant limit, say) the next attempt waits this long, so
# a refusing hierarchy costs a worker thread and a log line per this, not per command.
REFUSED_RETRY_S = 5.0
# A finished command's cgroup waits at most this long to be removed, so that one worker-thread
# hop removes a burst's: waking a worker costs the event loop about as much as the median
# rmdir it saves (about 0.1 ms each on the benchmark machine). A refill's hop takes them sooner.
RETIRE_DELAY_S = 0.05


def _report_busy(call_ids: list[str]) -> None:
    for call_id in call_ids:
        log.warning("process.cgroup_remove_failed", call_id=call_id)


def remove_all(retired: list[tuple[str, CommandCgroup]]) -> list[str]:
    """Remove the cgroups (in a worker thread); the calls of those still busy (a member
    between its exit and its removal from the group): the next start removes them with the
    leftovers, and a stop's `Cgroups.close` those left empty."""
    return [call_id for call_id, cgroup in retired if not cgroup.remove()]


class ReadyCgroups:
    """Cgroups to give commands: `take` on the call's path, `offer` for the host's idle
    shells, the refill in a worker thread started from the runtime's nursery; `retire`
    removes a finished command's in one too."""

    def __init__(self, cgroups: Cgroups, nursery: trio.Nursery, target: int = READY_TARGET) -> None:
        self._cgroups = cgroups
        self._nursery = nursery
        self._target = target
        self._plain: list[CommandCgroup] = []  # made, never offered: empty
        self._offered: list[CommandCgroup] = []  # offered to the host, oldest first
        self._refilling = False
        self._retired: list[tuple[str, CommandCgroup]] = []  # (call_id, cgroup) to remove
        self._removing = False
        self._retry_at = float("-inf")  # trio time before which no refill is tried (a refusal)

    @property
    def ready(self) -> int:
        return len(self._plain) + len(self._offered)

    def take(self, *, pooled: bool) -> CommandCgroup | None:
        """A cgroup for a command or a held process: the oldest offered one when the host's
        pool will run it (its idle shell is the likeliest to be in it), else one never
        offered; None when none is ready (the caller makes the call's own)."""
        taken: CommandCgroup | None = None
        while taken is None:
            if pooled and self._offered:
                taken = self._offered.pop(0)
            elif self._plain:
                taken = self._plain.pop()
            else:
                break
            if not os.path.isdir(taken.membership):
                # An empty cgroup is anyone's to remove (root's clean-up of leftovers, say):
                # one that went is not handed out, where its spawn would fail and be retried.
                taken = None
        self._maybe_refill()
        return taken

    def offer(self, wanted: int) -> list[CommandCgroup]:
        """Ready cgroups to offer the host until `wanted` are on offer (the host's pool size):
        the ones newly offered, for this spawn request's `place`."""
        offered: list[CommandCgroup] = []
        while len(self._offered) < wanted and self._plain:
            cgroup = self._plain.pop()
            self._offered.append(cgroup)
            offered.append(cgroup)
        if offered:
            self._maybe_refill()
        return offered

    def retire(self, call_id: str, cgroup: CommandCgroup) -> None:
        """Remove a finished command's cgroup soon, off the event loop: at the latest
        RETIRE_DELAY_S from now, or sooner with a refill's worker-thread hop. Called as its
        command is forgotten, which may be on its call's path: nothing runs before this task
        yields, so after the call's result is journaled (CallRunner journals it with no
        checkpoint in between)."""
        self._retired.append((call_id, cgroup))
        if self._removing:
            return  # the removal under way takes it
        try:
            self._nursery.start_soon(self._remove_retired)
            self._removing = True
        except RuntimeError:  # the nursery is closing (a stop): Cgroups.close removes it
            self._retired.clear()

    async def _remove_retired(self) -> None:
        try:
            # Cancelled here by a stop: Cgroups.close removes what is queued. A hop under
            # way is not abandoned: a stop waits for its rmdirs (up to 20 ms each, measured).
            await trio.sleep(RETIRE_DELAY_S)
            while self._retired:
                batch, self._retired = self._retired, []
                _report_busy(await trio.to_thread.run_sync(remove_all, batch))
        finally:
            self._removing = False

    def _maybe_refill(self) -> None:
        if len(self._plain) < READY_LOW and not self._refilling and trio.current_time() >= self._retry_at:
            self._refilling = True
            try:
                self._nursery.start_soon(self._refill)
            except RuntimeError:  # the nursery is closing (a stop): none are needed any more
                self._refilling = False

    async def _refill(self) -> None:
        try:
            wanted = self._target - len(self._plain)
            restored = self._cgroups.bases_restored
            retired, self._retired = self._retired, []  # removed in the same hop, first
            made, refusal, busy = await trio.to_thread.run_sync(self._make_after, retired, wanted)
            _report_busy(busy)
            self._plain.extend(made)
            if self._cgroups.bases_restored != restored:
                log.warning("cgroup.base_restored", by="ready_cgroups")
            if refusal is not None:
                log.info("cgroup.ready_refused", error=refusal, made=len(made))
                self._retry_at = trio.current_time() + REFUSED_RETRY_S
        finally:
            self._refilling = False

    def _make_after(
        self, retired: list[tuple[str, CommandCgroup]], count: int
    ) -> tuple[list[CommandCgroup], str | None, list[str]]:
        """Remove the retired cgroups (which also frees room under a descendant limit), then
        make `count`; `_make`'s answer and `remove_all`'s."""
        busy = remove_all(retired)
        return (*self._make(count), busy)

    def _make(self, count: int) -> tuple[list[CommandCgroup], str | None]:
        """`count` new cgroups, limits set, and why fewer were made (the commands then make
        their own, and the refusal is theirs to report)."""
        made: list[CommandCgroup] = []
        try:
            for _ in range(count):
                made.append(self._cgroups.create(READY_PREFIX + uuid.uuid4().hex))
        except OSError as exc:
            return made, exc.strerror or str(exc)
        return made, None
