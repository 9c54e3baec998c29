"""A command's output, from its pipes to the spool, the live events and the result (docs/protocol.md §7.4).

Each of stdout and stderr is read by one task that writes every byte to the stream's spool
(lossless, on disk, capped), its live view (bounded, lossy) and its head/tail summary; a
flusher task turns the live views into throttled `exec.output` events in the journal. The
tasks run until the call has completed *and* both pipes have closed: output from background
descendants keeps arriving (`after_exit: true`) after the call has completed.

`SpoolBudget` keeps the total size of all spools under `exec.spool_total_max_bytes`, deleting
the oldest finished ones.

The policy lives in plain modules: `output` (the live view, the summary) and `spool` (the
record); this module is the trio plumbing between a pair of pipes and them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol.fields import STREAMS, Stream
from sandbox_supervisor.protocol.frames import EXEC_OUTPUT
from sandbox_supervisor.daemon.runtime.output import LiveOutput, OutputChunk, StreamHeadTail
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter, prune_spools, spool_usage, stream_path
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.telemetry import Telemetry
from sandbox_supervisor.daemon.state.store import StoreError

__all__ = [
    "CLOCK_EPSILON_S",
    "READ_CHUNK_BYTES",
    "CommandOutput",
    "OutputLimits",
    "SpoolBudget",
    "StreamOutput",
    "output_event",
]

log = structlog.get_logger("supervisor.shell")

READ_CHUNK_BYTES = 64 * 1024
# Added to a throttle window's end before sleeping until it: due() compares in ms, the clock
# is in s, and waking a rounding error early would loop once for nothing.
CLOCK_EPSILON_S = 1e-6

Event = tuple[str, dict[str, Any]]


def output_event(call_id: str, stream: Stream, chunk: OutputChunk) -> Event:
    return (EXEC_OUTPUT, chunk.event_body(call_id, stream))


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputLimits:
    """The `exec.*` output settings one command's pipeline needs."""

    throttle_ms: float
    max_chunk_bytes: int
    buffer_bytes: int
    spool_max_bytes: int


class StreamOutput:
    """One stream of one command: its spool, its live view and its result summary, fed the
    same bytes."""

    def __init__(self, spool: SpoolWriter, live: LiveOutput, summary: StreamHeadTail | None = None) -> None:
        self.spool = spool
        self.live = live
        self.summary = summary if summary is not None else StreamHeadTail()
        self.closed = False  # the pipe reached its end (or its reader stopped)

    def feed(self, data: bytes) -> int:
        """Bytes the spool kept (fewer than fed past its cap or on a disk error)."""
        kept = self.spool.write(data)
        self.summary.feed(data)
        self.live.feed(data)
        return kept

    def summary_body(self) -> dict[str, Any]:
        """protocol.tools.StreamSummary; truncated when the spool did not keep every byte."""
        return self.summary.summary(truncated=self.spool.truncated)


class CommandOutput:
    """Both streams of one command and the tasks that move its bytes (see the module doc)."""

    def __init__(
        self,
        call_id: str,
        streams: Mapping[Stream, StreamOutput],
        journal: Journal,
        telemetry: Telemetry | None = None,
        origin: str | None = None,
    ) -> None:
        if set(streams) != set(STREAMS):
            raise ValueError(f"a command's output has the streams {STREAMS}")
        self.call_id = call_id
        self.streams: dict[Stream, StreamOutput] = {name: streams[name] for name in STREAMS}
        self._journal = journal
        self._telemetry = telemetry
        # The allowed_commands the command runs under: who may see its output (§9.1).
        self._origin = origin
        # Set once the call's exec.completed is built: later chunks are after_exit, and the
        # flusher ends once both pipes are closed and drained.
        self.call_completed = False
        self._wake = trio.Event()  # data, completion or close: the flusher looks again
        self.closed = trio.Event()  # both pipes have reached their end
        self.finished = trio.Event()  # readers and flusher done, spools closed
        # The call has completed and both pipes are closed: nothing is left but the flusher's
        # last round, which must not wait for a throttle window to end.
        self._drained = trio.Event()

    @classmethod
    def open(
        cls,
        state_dir: Path,
        call_id: str,
        limits: OutputLimits,
        journal: Journal,
        telemetry: Telemetry | None = None,
        origin: str | None = None,
    ) -> CommandOutput:
        """Create the call's spool (its directory now; each stream's file with its first
        byte). OSError when it cannot be created — FileExistsError for a call that already
        has one."""
        streams: dict[Stream, StreamOutput] = {}
        try:
            for name in STREAMS:
                streams[name] = StreamOutput(
                    SpoolWriter(stream_path(state_dir, call_id, name), limits.spool_max_bytes),
                    LiveOutput(limits.throttle_ms, limits.max_chunk_bytes, limits.buffer_bytes),
                )
        except BaseException:
            for stream in streams.values():
                stream.spool.close()
            raise
        return cls(call_id, streams, journal, telemetry, origin)

    # --- what the call asks ----------------------------------------------------------------

    def final_events(self, now_ms: float) -> list[Event]:
        """Everything left in the live views, whatever the throttle: the exec.output events
        journaled with exec.completed. Call `complete` right after, before any checkpoint."""
        return [
            output_event(self.call_id, name, chunk)
            for name, stream in self.streams.items()
            for chunk in stream.live.flush(now_ms, final=True)
        ]

    def complete(self) -> None:
        """The call has completed: what arrives from now on is after_exit, and the tasks end
        once both pipes are closed and drained."""
        self.call_completed = True
        self._wake.set()
        self._check_drained()

    def _check_drained(self) -> None:
        if self.call_completed and self.closed.is_set():
            self._drained.set()

    def summary_body(self, name: Stream) -> dict[str, Any]:
        return self.streams[name].summary_body()

    def writer_alive(self, name: Stream) -> bool:
        """More bytes may still reach this stream's spool."""
        return not self.streams[name].spool.closed

    @property
    def spooled_bytes(self) -> int:
        """Bytes kept in both spool files."""
        return sum(stream.spool.size for stream in self.streams.values())

    def close(self) -> None:
        """Close both spools (recording their final state). Idempotent."""
        for stream in self.streams.values():
            stream.spool.close()

    # --- the tasks --------------------------------------------------------------------------

    async def pump(self, pipes: Mapping[Stream, trio.abc.ReceiveStream]) -> None:
        """Read both pipes to their end and journal the live views, until the call has
        completed and both pipes are drained. However it ends, the spools are closed and
        `finished` is set."""
        try:
            if set(pipes) != set(self.streams):
                raise ValueError(f"pump needs one pipe per stream {STREAMS}")
            async with trio.open_nursery() as nursery:
                for name in STREAMS:
                    nursery.start_soon(self._read, name, pipes[name])
                nursery.start_soon(self._flush_live)
        finally:
            self.finished.set()
            self.close()

    async def _read(self, name: Stream, pipe: trio.abc.ReceiveStream) -> None:
        stream = self.streams[name]
        try:
            while True:
                # bytes() of a bytes object is that object: no copy for trio's pipes.
                data = bytes(await pipe.receive_some(READ_CHUNK_BYTES))
                if not data:
                    break
                kept = stream.feed(data)
                if self._telemetry is not None:
                    self._telemetry.output_spooled(kept)
                self._wake.set()
        finally:
            stream.closed = True
            stream.spool.close()
            await trio.aclose_forcefully(pipe)
            if all(s.closed for s in self.streams.values()):
                self.closed.set()
                self._wake.set()
                self._check_drained()

    async def _flush_live(self) -> None:
        """Emit throttled exec.output events until the call has completed and both streams
        are closed and drained. Bytes that arrive inside a throttle window wait for its end;
        the final flush before exec.completed is the call's (`final_events`), synchronous."""
        while True:
            self._wake = trio.Event()
            now_ms = trio.current_time() * 1000
            events = [
                output_event(self.call_id, name, chunk)
                for name, stream in self.streams.items()
                if stream.live.due(now_ms)
                for chunk in stream.live.flush(now_ms, after_exit=self.call_completed)
            ]
            if self.call_completed and self.closed.is_set():
                # The last bytes of descendants that outlived the shell.
                events += [
                    output_event(self.call_id, name, chunk)
                    for name, stream in self.streams.items()
                    for chunk in stream.live.flush(now_ms, final=True, after_exit=True)
                ]
                self._journal_output(events)
                return
            self._journal_output(events)
            wake_at = [t for t in (s.live.next_flush_at() for s in self.streams.values()) if t is not None]
            if wake_at:
                # Bytes inside a throttle window wait for its end — unless the output ends
                # first: its last flush ignores the throttle, so nothing is left to wait for.
                with trio.move_on_at(min(wake_at) / 1000 + CLOCK_EPSILON_S):
                    await self._drained.wait()
            else:
                await self._wake.wait()

    def _journal_output(self, events: list[Event]) -> None:
        if not events:
            return
        try:
            self._journal.append(events, origin=self._origin)
        except StoreError:
            # The live view is lossy by design: the bytes are in the spool, and the next
            # event's offset shows the gap, so a full disk costs events, not the daemon.
            log.warning("exec.output_not_journaled", call_id=self.call_id, events=len(events))


class SpoolBudget:
    """The bytes in all spools against `exec.spool_total_max_bytes`.

    Tracked in memory so that the cap is checked without scanning the disk after every
    command; the disk is scanned (and the oldest finished spools deleted) only when the
    count passes the cap.
    """

    def __init__(self, state_dir: Path, cap_bytes: int) -> None:
        self.state_dir = state_dir
        self.cap_bytes = cap_bytes
        self.bytes = sum(u.bytes for u in spool_usage(state_dir))

    def add(self, nbytes: int) -> bool:
        """Count a finished command's spool; True when the total is now past the cap."""
        self.bytes += nbytes
        return self.bytes > self.cap_bytes

    async def prune(self, keep: set[str]) -> None:
        """Delete the oldest spools not in `keep` until all fit under the cap (see
        spool.prune_spools), in a worker thread; the count is then the disk's."""
        try:
            with trio.CancelScope(shield=True):  # a half-done prune would only be redone
                removed, self.bytes = await trio.to_thread.run_sync(
                    prune_spools, self.state_dir, self.cap_bytes, keep
                )
        except OSError:
            log.exception("spool.prune_failed")
            return
        if removed:
            log.info("spool.pruned", calls=len(removed), bytes_left=self.bytes)
