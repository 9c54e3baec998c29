"""The per-socket sender: the task that makes its socket's writes (but for a call's result, below).

It sends, in a loop: queued replies (not journaled), then journaled events after its cursor,
read from sqlite in batches, each as it is or — outside what the socket's assertion lets it
see — as `event.withheld` (docs/protocol.md §9.1). Producers never wait for it; a slow client only makes this task
wait, and memory stays bounded (a batch of events plus a bounded reply queue).

Everything one wake-up finds ready goes out in as few socket writes as it fits in
(`ServerWebSocket.send_messages`): on loopback a write costs the receiver's network processing too, so an
acknowledgement and the output it caused, or a replay's batch, cost one system call, not one
per frame.

A call's result is the exception (`wake(now=True)`): when the sender is parked with nothing
left to write, the task that journaled the result writes it at once, from the journal's
wake-up (`ServerWebSocket.write_now`: no wait, no checkpoint), instead of handing it to this
task through a pass of the event loop. The result is on the wire before its call's log line
and bookkeeping run, and the sender's cursor moves as if it had written it. Anything that
would make that write wait (the write lock held, a full socket, a queued reply) leaves the
result to this task as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import trio

from sandbox_supervisor.daemon.websocket import WRITE_BATCH_MAX_BYTES, ConnectionClosed, Outgoing, ServerWebSocket, outgoing_size
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StoreError
from sandbox_supervisor.daemon.state.visibility import Audience
from sandbox_supervisor.daemon.telemetry import Telemetry

# Bounded: a client that floods requests without reading replies is slowed at its own
# reader (back-pressure), never allowed to grow the daemon's memory.
REPLY_QUEUE_SIZE = 64
# ...and bounded in size: a binary output page is up to 1 MiB (protocol/frames.py), so 64 of
# them would be 64 MiB. A reply waits while the queue holds this much (a single larger one
# still goes through alone).
REPLY_QUEUE_MAX_CHARS = 4 * 1024 * 1024
# Large enough that a 100,000-event replay costs few queries, small enough to bound memory:
# at most this many events, and a batch ends once it holds EVENT_BATCH_MAX_CHARS (one event
# can be ~400 KB once JSON-escaped: a read_file page of control characters).
EVENT_BATCH = 128
EVENT_BATCH_MAX_CHARS = 4 * 1024 * 1024
# Without a configured one (tests of the sender alone): the default of websocket.write_timeout_s.
DEFAULT_WRITE_TIMEOUT_S = 60.0
class _Stalled(Exception):
    """A write did not complete within the write timeout: the peer stopped reading."""


class SocketSender:
    def __init__(
        self,
        ws: ServerWebSocket,
        journal: Journal,
        cursor: int,
        telemetry: Telemetry | None = None,
        audience: Audience | None = None,
        *,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        on_stalled: Callable[[], None] | None = None,
    ) -> None:
        self._ws = ws
        self._write_timeout_s = write_timeout_s
        # Told once when a write times out (the socket closes it); the sender then stops.
        self._on_stalled = on_stalled
        self.stalled = False
        self._audience = audience
        self._telemetry = telemetry
        # Events up to here existed when the socket attached: sending them is a replay.
        self._replay_until = journal.last_seq
        self._journal = journal
        self.cursor = cursor  # the highest seq sent (or known to the client) so far
        self._reply_in, self._reply_out = trio.open_memory_channel[Outgoing](REPLY_QUEUE_SIZE)
        self._queued_chars = 0  # characters (or bytes, of a binary reply) in the reply queue
        self._dequeued = trio.Event()  # set (and replaced) each time a reply leaves the queue
        self._wake = trio.Event()
        # Set (and replaced) each time the cursor moves, and once the sender stops: what
        # `flush` waits on.
        self._progress = trio.Event()
        self.failed = False
        self.stopped = False
        # One scope for the sender's life, whose deadline is finite only while a write waits
        # (a write sets it when it first has to wait: ServerWebSocket._write; `_end_write`
        # clears it): a stalled peer is caught exactly as with a scope per write, without
        # entering and leaving a scope, or setting a deadline, for every write on the hot
        # path (3-4 % of the daemon's busy time on a keystroke's round trip, and a µs or two
        # per deadline set). Nothing else cancels it, so its cancellation means a write
        # timed out.
        self._write_scope = trio.CancelScope()
        self._parked = False  # waiting for a wake-up, with nothing left to write
        self._queued = 0  # replies in the queue (the channel's statistics cost a µs each)
        # A write from a call's task left a carry: whichever write finishes it, the next pass
        # tells `flush` to look again (its waiter saw `sent_through` false).
        self._owes_progress = False

    def wake(self, now: bool = False) -> None:
        """Something was journaled (or a flush wants the cursor to move). `now`: a call's
        result, which the waking task writes itself when this task is parked (see the module
        docstring); otherwise, or when that cannot be done without waiting, this task wakes."""
        if now and self._parked and not self._wake.is_set() and self._write_now():
            return
        self._wake.set()

    def _write_now(self) -> bool:
        """The events after the cursor written from the calling task: whether they were
        (`ServerWebSocket.write_now`). Replies go first in a pass, so none may be queued."""
        if self._queued or self.cursor >= self._journal.last_seq:
            return False
        try:
            rows = self._journal.frames_after(self.cursor, EVENT_BATCH, EVENT_BATCH_MAX_CHARS, self._audience)
            if not self._ws.write_now([frame for _, frame in rows]):
                return False
        except (StoreError, ValueError):
            # Not from memory and the store failed, or a frame that cannot be encoded: this
            # runs inside the commit that woke it, whose caller must not take this for its
            # own commit's failure (it would journal the call's result again). The sender's
            # own pass reads and writes them, and meets the same error in its own task.
            return False
        self._sent(rows)
        if self._ws.carrying:
            self._owes_progress = True
            self._wake.set()  # the rest of the write is this task's (or the next writer's)
        elif self.cursor < self._journal.last_seq:
            self._wake.set()  # more than a batch: the rest is this task's
        return True

    async def reply(self, text: Outgoing) -> None:
        """Queue a non-journaled frame (error, tool.pending, tool.replayed, runtime.state…);
        bytes go as a binary message (a binary exec.output_page). Once the sender has
        stopped (its socket failed or closed), the reply is dropped at once: nothing will
        write it, and a caller waiting for room would wait for good (the socket's reader,
        which then never learns that its socket is gone)."""
        size = outgoing_size(text)
        while self._queued_chars and self._queued_chars + size > REPLY_QUEUE_MAX_CHARS:
            if self.stopped:
                return
            await self._dequeued.wait()
        if self.stopped:
            return
        # Counted before it is queued: a reply waiting for room is moved into the queue by
        # the sender's receive, before this task resumes, and must already count then (a
        # pass sends events only once no reply is queued).
        self._queued_chars += size
        self._queued += 1
        try:
            # Room in the queue (the usual case): queued without a checkpoint, so the reply
            # and whatever the same step journals go out in this task's next pass together.
            self._reply_in.send_nowait(text)
        except trio.WouldBlock:
            try:
                await self._reply_in.send(text)
            except BaseException as exc:
                # Not queued after all (cancelled while the queue was full, or the sender
                # stopped: BrokenResourceError): its size and count are given back, or the
                # cap would shrink for good.
                self._queued_chars -= size
                self._queued -= 1
                if isinstance(exc, trio.BrokenResourceError):
                    return
                raise
        self._wake.set()

    async def run(self) -> None:
        """Send until the socket closes (or the task is cancelled with its connection)."""
        self._journal.subscribe(self.wake)
        try:
            with self._write_scope:
                wrote = False
                while True:
                    self._wake = trio.Event()
                    if wrote and self._has_work():
                        # A write that the socket takes at once does not yield (the edge's
                        # stream writes directly): writing again straight after, as under a
                        # replay or a burst, would keep every other task of the daemon
                        # waiting. One pass of the event loop between such writes; none on a
                        # keystroke's way (its pass after the write finds nothing and waits).
                        # Not shielded: it is also where a connection's end (its cancellation)
                        # reaches a sender that a fast reader keeps busy, as under a long replay
                        # (the write deadline is cleared after each write, so it cannot fire here).
                        await trio.lowlevel.checkpoint()
                    wrote = await self._pass()
                    if not wrote:
                        self._parked = True
                        try:
                            await self._wake.wait()
                        finally:
                            self._parked = False
            # The loop never ends by itself: here, the write deadline cancelled it.
            raise _Stalled
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            self.failed = True
        except _Stalled:
            self.failed = self.stalled = True
            if self._on_stalled is not None:
                self._on_stalled()
        finally:
            self._journal.unsubscribe(self.wake)
            self.stopped = True
            self._progress.set()
            # Replies waiting for room give up (`reply`): a full queue's waiter gets
            # BrokenResourceError, a waiter for characters is woken to see `stopped`.
            self._reply_out.close()
            self._dequeued.set()

    def _has_work(self) -> bool:
        """Something to write: a queued reply, the rest of a write begun elsewhere, or an
        event after the cursor."""
        return self._queued > 0 or self._ws.carrying or self.cursor < self._journal.last_seq

    async def _pass(self) -> bool:
        """Write every queued reply, then the next batch of events after the cursor, in as
        few writes as they fit in; whether there was anything to write."""
        texts = self._take_replies()
        # Replies go before events (a bind's runtime.state before its replay): while
        # some are still queued, this pass sends replies only.
        rows = (
            self._journal.frames_after(self.cursor, EVENT_BATCH, EVENT_BATCH_MAX_CHARS, self._audience)
            if self.cursor < self._journal.last_seq and not self._queued
            else []
        )
        if not texts and not rows:
            if self._ws.carrying:
                # Only the rest of a result written from its call's task (`_write_now`), or
                # what another writer that took it has not finished (the lock is waited for).
                await self._ws.flush_carry(self._write_scope, self._write_timeout_s)
                self._end_write()
                self._moved()
                return True
            if self._owes_progress:
                self._moved()  # another write (a pong, a ping) finished the carry
            return False
        texts.extend(frame for _, frame in rows)
        await self._send(texts)  # the carry first, if one was left
        if rows:
            self._sent(rows)
        elif self._owes_progress:
            self._moved()
        return True

    def _moved(self) -> None:
        """Wake `flush`: the cursor moved, or the carry was written."""
        self._owes_progress = False
        self._progress.set()
        self._progress = trio.Event()

    def _sent(self, rows: Sequence[tuple[int, str]]) -> None:
        """The cursor moved past `rows` (written, or handed to the socket's carry)."""
        self.cursor = rows[-1][0]
        self._moved()
        if self._telemetry is not None and rows[0][0] <= self._replay_until:
            self._telemetry.events_replayed(sum(1 for seq, _ in rows if seq <= self._replay_until))

    def sent_through(self, seq: int) -> bool:
        """Every event up to `seq` has been sent on this socket (none of it is left in the
        socket's carry), or acknowledged (the client has it already, and the journal may
        have pruned it)."""
        if self._journal.pruned_through >= seq:
            return True
        return self.cursor >= seq and not self._ws.carrying

    async def flush(self, seq: int) -> None:
        """Return once every event up to `seq` has been sent (or acknowledged), or the sender
        has stopped (its socket failed or closed). The caller bounds the wait: a client that
        does not read keeps this waiting."""
        self.wake()
        while not self.stopped and not self.sent_through(seq):
            await self._progress.wait()

    def _take_replies(self) -> list[Outgoing]:
        """The queued replies, in order, up to one write's worth (WRITE_BATCH_MAX_BYTES, at
        least one reply): what is taken leaves the queue's count at once, so the replies held
        in memory stay within REPLY_QUEUE_MAX_CHARS plus one write."""
        texts: list[Outgoing] = []
        taken = 0
        while taken < WRITE_BATCH_MAX_BYTES:
            try:
                text = self._reply_out.receive_nowait()
            except trio.WouldBlock:
                break
            size = outgoing_size(text)
            self._queued -= 1
            self._queued_chars -= size
            taken += size
            texts.append(text)
        if texts:
            self._dequeued.set()
            self._dequeued = trio.Event()
        return texts

    async def _send(self, texts: Sequence[Outgoing]) -> None:
        """Frames in order, each write within the write timeout. A write cut short leaves a
        partial frame on the stream, so the socket is not used again: the cancellation ends
        `run`'s loop, and the sender, as stalled. A write that finishes after its deadline has
        passed counts as stalled too (the cancellation is already called)."""
        await self._ws.send_messages(texts, deadline_scope=self._write_scope, write_timeout_s=self._write_timeout_s)
        self._end_write()

    def _end_write(self) -> None:
        """No deadline between writes: an idle socket waits for work. (A write sets one only
        once it has to wait, so most writes leave nothing to clear.)"""
        if self._write_scope.deadline != math.inf:
            self._write_scope.deadline = math.inf

