"""The session's event journal: the store's append plus a wake-up for the socket senders.

Producers (tool calls, commands) only ever append; they never wait for a socket. Each
attached socket's sender reads from the journal by cursor, so replay and live delivery are
one path and nothing can be skipped or reordered at the seam between them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import trio

from sandbox_supervisor.protocol.frames import encode_withheld
from sandbox_supervisor.daemon.state.keys import CallKey
from sandbox_supervisor.daemon.state.store import (
    AckAhead,
    HeldRecord,
    JournalRow,
    StateStore,
    StoreError,
    take_within,
)
from sandbox_supervisor.daemon.state.visibility import Audience, EventView, visible


RECENT_FRAMES = 1024
# The same memory also bounded by size: one read_file page of control characters is ~400 KB
# of JSON, and 1024 of them would pin ~400 MiB. Counted in characters (len of the str).
RECENT_MAX_CHARS = 4 * 1024 * 1024


class Journal:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._listeners: set[Callable[[bool], None]] = set()
        # Held events (`_appended`'s `hold_s`): the scope of `wake_held`'s sleep, while that
        # task runs; its deadline is when the senders must be woken for them (inf: none
        # held). Without the task nothing is held.
        self._held_scope: trio.CancelScope | None = None
        # The highest seq committed, kept here so a sender can tell "nothing new" without a
        # query. Everything that appends after start goes through this class.
        snapshot = store.snapshot()
        self.last_seq = snapshot.local_event_max
        # The most recent frames, dense by seq: a sender that keeps up reads live events
        # from here instead of querying sqlite for each one. Bounded by count and by size,
        # and acked frames leave it (they are pruned from the store too).
        self.recent: deque[JournalRow] = deque()
        self._recent_chars = 0
        # The ack floor: what the store may have deleted (acks only ever go through here).
        self.pruned_through = snapshot.ack_floor
        # The highest ack the store could not record yet (a full disk): acks are monotonic,
        # so this one floor stands for every ack received meanwhile. Written by the next
        # ack that succeeds or by `retry_deferred_ack`; 0: none deferred.
        self.deferred_ack = 0
        # The bytes of the events above the recorded floor (the journal's bound, [journal]
        # max_unacked_bytes): counted once here, then kept by appends and acks.
        self.unacked_bytes = store.frame_bytes(snapshot.ack_floor)

    def frames_after(
        self, seq: int, limit: int, max_chars: int | None = None, audience: Audience | None = None
    ) -> list[tuple[int, str]]:
        """Up to `limit` events after `seq`, in order, as (seq, frame) for a socket with
        `audience` (None: one that sees everything): an event outside its view is sent as
        `event.withheld`, so every seq still arrives once (docs/protocol.md §9.1)."""
        rows = self.rows_after(seq, limit, max_chars)
        if audience is None or audience.sees_everything:
            return [(row.seq, row.frame) for row in rows]
        return [(row.seq, row.frame if visible(row.view, audience) else encode_withheld(row.seq)) for row in rows]

    def rows_after(self, seq: int, limit: int, max_chars: int | None = None) -> list[JournalRow]:
        """Up to `limit` events after `seq`, in order: from memory when they are recent,
        else from the store (a replay). With `max_chars` the batch ends once that many
        characters are gathered (at least one event), the same rule on both paths."""
        recent = self.recent
        # Pruned events are not served from memory either: a reconnect below the oldest
        # retained event is replayed from there, the same whichever path serves it.
        if recent and max(recent[0].seq, self.pruned_through + 1) <= seq + 1 <= recent[-1].seq:
            start = seq + 1 - recent[0].seq
            stop = min(start + limit, len(recent))
            if len(recent) - start <= start:
                # Nearer the newest end (a sender that keeps up: the last frame or two of up
                # to RECENT_FRAMES): walked from there, not past every older frame first.
                window = list(itertools.islice(reversed(recent), len(recent) - stop, len(recent) - start))
                window.reverse()
            else:
                window = list(itertools.islice(recent, start, stop))
            # Dense as appended, unless events landed whose commit reported an error (the
            # store reads its last seq again; this window was told they failed): then it
            # has a hole, and is dropped rather than served across it (the events after
            # the hole would go out in place of those in it). Appends refill it.
            if window[0].seq == seq + 1 and window[-1].seq - window[0].seq == len(window) - 1:
                return window if max_chars is None else take_within(window, max_chars)
            recent.clear()
            self._recent_chars = 0
        return self.store.rows_after(seq, limit, max_chars)

    def acknowledge(self, seq: int) -> int:
        """Raise the ack floor (AckAhead above the journal) and prune what it covers, in one
        transaction; the floor now recorded. When the store cannot record it (a full disk,
        StoreError), the ack is kept as `deferred_ack` and written later (`retry_deferred_ack`):
        the client's ack is never refused for the daemon's own fault, and nothing is pruned
        until the floor is durable."""
        if seq > self.last_seq:
            # Checked here too, so a deferred ack can never be one the store would refuse.
            raise AckAhead(f"ack {seq} is above the highest journaled seq {self.last_seq}")
        previous = self.pruned_through
        try:
            target = max(seq, self.deferred_ack)
            # Read before the floor moves (no await between: nothing appends meanwhile).
            covered = self.store.frame_bytes(previous, target) if target > previous else 0
            floor = self.store.raise_ack_floor(target)
        except StoreError:
            if seq > max(self.deferred_ack, self.pruned_through):
                self.deferred_ack = seq
            raise
        self.deferred_ack = 0
        if floor > previous:
            self.unacked_bytes = max(0, self.unacked_bytes - covered)
        self.pruned_through = max(self.pruned_through, floor)
        self._trim_recent()
        return floor

    def retry_deferred_ack(self) -> int | None:
        """Write the deferred ack, if any: the floor now recorded, None when none was
        deferred (StoreError: still not recorded, and still deferred)."""
        if not self.deferred_ack:
            return None
        return self.acknowledge(self.deferred_ack)

    def _trim_recent(self) -> None:
        """Drop the oldest frames past the bounds, and those an ack pruned. Only the oldest
        end is cut, so what is left stays dense (frames_after relies on it)."""
        recent = self.recent
        while recent and (
            len(recent) > RECENT_FRAMES
            or self._recent_chars > RECENT_MAX_CHARS
            or recent[0].seq <= self.pruned_through
        ):
            self._recent_chars -= len(recent.popleft().frame)

    def subscribe(self, wake: Callable[[bool], None]) -> None:
        """`wake(now)` is called after each commit of events; `now` when they end a call (its
        tool.result), which a parked sender may then write from the committing task."""
        self._listeners.add(wake)

    def unsubscribe(self, wake: Callable[[bool], None]) -> None:
        self._listeners.discard(wake)

    def _appended(self, rows: list[JournalRow], hold_s: float | None = None, *, ends_call: bool = False) -> None:
        """Keep the committed rows for the senders and wake them; with `hold_s`, wake them
        only at the next append or after `hold_s`, whichever comes first (`wake_held`).
        `ends_call`: the rows end a call (its tool.result), which a parked sender may write
        from here (SocketSender.wake)."""
        if rows:
            self.last_seq = max(self.last_seq, rows[-1].seq)
            self.recent.extend(rows)
            chars = sum(len(row.frame) for row in rows)
            self._recent_chars += chars
            # Frames are JSON, nearly always ASCII: then characters are bytes, no encoding.
            self.unacked_bytes += sum(
                len(row.frame) if row.frame.isascii() else len(row.frame.encode("utf-8")) for row in rows
            )
            self._trim_recent()
        scope = self._held_scope
        if scope is not None:
            if hold_s is not None:
                # The earliest hold counts: a later one never pushes another's send back.
                scope.deadline = min(scope.deadline, trio.current_time() + hold_s)
                return
            if scope.deadline != math.inf:
                scope.deadline = math.inf  # sent now with these rows: the hold is over
        self._wake_listeners(ends_call)

    def _wake_listeners(self, ends_call: bool = False) -> None:
        for wake in list(self._listeners):
            wake(ends_call)

    async def wake_held(self) -> None:
        """Wake the senders once a held event's hold is over and nothing appended since has
        sent it (`_appended`). Runs for the daemon's life; while it does not, nothing is
        held. A stop's last flush (SessionHub.flush_all) wakes every sender itself."""
        scope = trio.CancelScope()
        try:
            while True:
                self._held_scope = scope
                with scope:
                    await trio.sleep_forever()
                # Its deadline passed: the hold is over, unless an append ended it since.
                self._held_scope = None
                self._end_hold(scope)
                scope = trio.CancelScope()
        finally:
            # Cancelled (the daemon stops): a hold taken while the cancellation was on its
            # way here had no task left to end it, so it ends now.
            self._held_scope = None
            self._end_hold(scope)

    def _end_hold(self, scope: trio.CancelScope) -> None:
        """Wake the senders for the hold `scope` kept, if one was still pending."""
        if scope.deadline != math.inf:
            self._wake_listeners()

    def append(self, events: Sequence[tuple[str, dict[str, Any]]], origin: str | None = None) -> list[JournalRow]:
        """Commit events (dense seqs) and wake the senders; `origin`: see StateStore."""
        rows = self.store.append_events(events, origin=origin)
        self._appended(rows)
        return rows

    def complete_call(
        self,
        key: CallKey | None,
        result_body: dict[str, Any],
        preceding: Sequence[tuple[str, dict[str, Any]]] = (),
        view: EventView | None = None,
        origin: str | None = None,
    ) -> list[JournalRow]:
        """Journal a call's final events and complete its idempotency record atomically."""
        rows = self.store.complete_call(key, result_body, preceding=preceding, view=view, origin=origin)
        self._appended(rows, ends_call=True)
        return rows

    def release_call(self, key: CallKey, result_body: dict[str, Any], view: EventView | None = None) -> list[JournalRow]:
        """Journal a refusal that leaves nothing done and free the key (see StateStore)."""
        rows = self.store.release_call(key, result_body, view=view)
        self._appended(rows, ends_call=True)
        return rows

    def start_process(
        self,
        call_id: str,
        pid: int,
        pgid: int,
        start_ticks: int,
        started_body: dict[str, Any],
        origin: str | None = None,
        cgroup: str | None = None,
        hold_s: float | None = None,
    ) -> list[JournalRow]:
        """Record a spawned process group and journal its exec.started, in one transaction;
        `hold_s`: how long its send may wait for the command's next event (`_appended`)."""
        rows = self.store.start_process(call_id, pid, pgid, start_ticks, started_body, origin, cgroup)
        self._appended(rows, hold_s)
        return rows

    def start_held(self, record: HeldRecord, started_body: dict[str, Any]) -> list[JournalRow]:
        """Record a held process and journal its exec.started, in one transaction."""
        rows = self.store.start_held(record, started_body)
        self._appended(rows)
        return rows

    def append_held_output(
        self, call_id: str, events: Sequence[tuple[str, dict[str, Any]]], sent: dict[str, int], origin: str | None
    ) -> list[JournalRow]:
        """Journal a held process's live events with where its live view now stands."""
        rows = self.store.append_held_output(call_id, events, sent, origin)
        self._appended(rows)
        return rows

    def end_held(
        self,
        call_id: str,
        events: Sequence[tuple[str, dict[str, Any]]],
        sent: dict[str, int],
        exit_json: str,
        origin: str | None,
    ) -> list[JournalRow]:
        """Journal a held process's last events and its exec.completed, exactly once."""
        rows = self.store.end_held(call_id, events, sent, exit_json, origin)
        self._appended(rows)
        return rows
