"""The per-socket sender: one task that owns every write to its socket.

It sends, in a loop: queued replies (not journaled), then journaled events after its cursor,
read from sqlite in batches, each as it is or — outside what the socket's assertion lets it
see — as `event.withheld` (docs/protocol.md §9.1). Producers never wait for it; a slow client only makes this task
wait, and memory stays bounded (a batch of events plus a bounded reply queue).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio_websocket

from sandbox_supervisor.daemon.state.journal import Journal
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
        ws: trio_websocket.WebSocketConnection,
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
        self._reply_in, self._reply_out = trio.open_memory_channel[str | bytes](REPLY_QUEUE_SIZE)
        self._queued_chars = 0  # characters (or bytes, of a binary reply) in the reply queue
        self._dequeued = trio.Event()  # set (and replaced) each time a reply leaves the queue
        self._wake = trio.Event()
        # Set (and replaced) each time the cursor moves, and once the sender stops: what
        # `flush` waits on.
        self._progress = trio.Event()
        self.failed = False
        self.stopped = False

    def wake(self) -> None:
        self._wake.set()

    async def reply(self, text: str | bytes) -> None:
        """Queue a non-journaled frame (error, tool.pending, tool.replayed, runtime.state…);
        bytes go as a binary message (a binary exec.output_page)."""
        while self._queued_chars and self._queued_chars + len(text) > REPLY_QUEUE_MAX_CHARS:
            await self._dequeued.wait()
        self._queued_chars += len(text)
        await self._reply_in.send(text)
        self._wake.set()

    async def run(self) -> None:
        """Send until the socket closes (or the task is cancelled with its connection)."""
        self._journal.subscribe(self.wake)
        try:
            while True:
                self._wake = trio.Event()
                sent = await self._send_replies()
                rows = (
                    self._journal.frames_after(self.cursor, EVENT_BATCH, EVENT_BATCH_MAX_CHARS, self._audience)
                    if self.cursor < self._journal.last_seq
                    else []
                )
                for seq, frame in rows:
                    await self._send(frame)
                    self.cursor = seq
                if rows:
                    self._progress.set()
                    self._progress = trio.Event()
                if rows and self._telemetry is not None and rows[0][0] <= self._replay_until:
                    self._telemetry.events_replayed(sum(1 for seq, _ in rows if seq <= self._replay_until))
                if not sent and not rows:
                    await self._wake.wait()
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            self.failed = True
        except _Stalled:
            self.failed = self.stalled = True
            if self._on_stalled is not None:
                self._on_stalled()
        finally:
            self._journal.unsubscribe(self.wake)
            self.stopped = True
            self._progress.set()

    def sent_through(self, seq: int) -> bool:
        """Every event up to `seq` has been sent on this socket, or acknowledged (the client
        has it already, and the journal may have pruned it)."""
        return max(self.cursor, self._journal.pruned_through) >= seq

    async def flush(self, seq: int) -> None:
        """Return once every event up to `seq` has been sent (or acknowledged), or the sender
        has stopped (its socket failed or closed). The caller bounds the wait: a client that
        does not read keeps this waiting."""
        self.wake()
        while not self.stopped and not self.sent_through(seq):
            await self._progress.wait()

    async def _send_replies(self) -> bool:
        sent = False
        while True:
            try:
                text = self._reply_out.receive_nowait()
            except trio.WouldBlock:
                return sent
            self._queued_chars -= len(text)
            self._dequeued.set()
            self._dequeued = trio.Event()
            await self._send(text)
            sent = True

    async def _send(self, text: str | bytes) -> None:
        """One frame, within the write timeout. A write cut short leaves a partial frame on
        the stream, so the socket is not used again: _Stalled ends the sender."""
        with trio.move_on_after(self._write_timeout_s) as scope:
            await self._ws.send_message(text)
        if scope.cancelled_caught:
            raise _Stalled
