"""A command's output, from its pipes to the spool, the live events and the result (docs/protocol.md §7.4).

Each of stdout and stderr is read by one task that writes every byte to the stream's spool
(lossless, on disk, capped), its live view (bounded, lossy) and its head/tail summary; a
flusher task, started with the first bytes read, turns the live views into throttled
`exec.output` events in the journal. The tasks run until the call has completed *and* both
pipes have closed: output from background descendants keeps arriving (`after_exit: true`)
after the call has completed.

`SpoolBudget` keeps the total size of all spools under `exec.spool_total_max_bytes`, deleting
the oldest finished ones; when the spools it may not delete (running commands', held
processes') alone pass the cap, the commands' writers keep nothing more.

The policy lives in plain modules: `output` (the live view, the summary) and `spool` (the
record); this module is the trio plumbing between a pair of pipes and them.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol.fields import STREAMS, Stream
from sandbox_supervisor.protocol.frames import EXEC_OUTPUT
from sandbox_supervisor.daemon.runtime.output import LiveOutput, OutputChunk, StreamHeadTail
from sandbox_supervisor.daemon.runtime.holder import OUTPUT_PIPE_BYTES
from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE, SPEC_FILE
from sandbox_supervisor.daemon.runtime.spool import (
    SpoolWriter,
    read_state,
    remove_spool,
    spool_dir,
    spool_usage,
    stream_path,
)
from sandbox_supervisor.daemon.runtime.spool_directories import ReadySpoolDirectories
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.telemetry import Telemetry
from sandbox_supervisor.daemon.state.store import StoreError

__all__ = [
    "CLOCK_EPSILON_S",
    "DRAIN_BYTES_PER_CHECKPOINT",
    "READ_CHUNK_BYTES",
    "CommandOutput",
    "NO_LIMIT",
    "PRUNE_SLACK_DIVISOR",
    "OutputLimits",
    "SpoolBudget",
    "StreamOutput",
    "output_event",
    "prune_finished_spools",
    "spools_being_written",
]

log = structlog.get_logger("supervisor.shell")

# One read takes what a full output pipe holds (holder.open_stdio sizes it): a command that
# prints faster than the daemon spools costs one loop turn per pipeful, not one per 64 KiB.
READ_CHUNK_BYTES = OUTPUT_PIPE_BYTES
# A reader whose reads keep coming back full (the pipe refills as fast as it is read) lets
# the other tasks run after this many bytes: about a millisecond of spooling at a time.
DRAIN_BYTES_PER_CHECKPOINT = 4 * READ_CHUNK_BYTES
# Added to a throttle window's end before sleeping until it: due() compares in ms, the clock
# is in s, and waking a rounding error early would loop once for nothing.
CLOCK_EPSILON_S = 1e-6

Event = tuple[str, dict[str, Any]]


# The call ids whose spool a CommandOutput of this process is still writing, by state
# directory. A call id is added before its spool's directory exists and removed once both of
# its writers are closed, so a prune (in a worker thread, scanning while commands start and
# end) never deletes a spool that a command still writes, whenever it looks: it checks the
# set right before each deletion, and a membership test is atomic under the GIL.
_BEING_WRITTEN: dict[str, set[str]] = {}


def spools_being_written(state_dir: str | os.PathLike[str]) -> set[str]:
    """The live set (not a copy) of call ids whose spools are written under `state_dir`."""
    return _BEING_WRITTEN.setdefault(os.path.abspath(state_dir), set())


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

    def __init__(
        self,
        spool: SpoolWriter,
        live: LiveOutput,
        summary: StreamHeadTail | None = None,
        budget: SpoolBudget | None = None,
    ) -> None:
        self.spool = spool
        self.live = live
        self.summary = summary if summary is not None else StreamHeadTail()
        self.closed = False  # the pipe reached its end (or its reader stopped)
        self.budget = budget  # all spools' cap, which this stream's kept bytes count against

    def feed(self, data: bytes | memoryview) -> int:
        """Bytes the spool kept (fewer than fed past its cap, past all spools' cap when the
        budget is full, or on a disk error)."""
        budget = self.budget
        if budget is None:
            return self._feed(data)
        if budget.bytes + len(data) > budget.limit:  # the hot path's one comparison
            # Up to the cap exactly, then nothing more (SpoolWriter.keep_at_most).
            self.spool.keep_at_most(budget.limit - budget.bytes)
        kept = self._feed(data)
        budget.bytes += kept
        return kept

    def _feed(self, data: bytes | memoryview) -> int:
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
        being_written: set[str] | None = None,
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
        # Where this spool is registered as being written (`open` registers it), until `close`.
        self._being_written = being_written
        # The readers' nursery while they run (`pump`), and whether the flusher was started
        # in it (with the first bytes read).
        self._pump_nursery: trio.Nursery | None = None
        self._flushing = False

    @classmethod
    def open(
        cls,
        state_dir: Path,
        call_id: str,
        limits: OutputLimits,
        journal: Journal,
        telemetry: Telemetry | None = None,
        origin: str | None = None,
        on_truncated: Callable[[Stream], None] | None = None,
        budget: SpoolBudget | None = None,
        ready: ReadySpoolDirectories | None = None,
    ) -> CommandOutput:
        """Create the call's spool (its directory now; each stream's file with its first
        byte). OSError when it cannot be created — FileExistsError for a call that already
        has one. `on_truncated(stream)`: called when a stream first drops bytes. `budget`:
        the kept bytes count against it, and it may stop them (SpoolBudget). `ready`: the
        directory is one of these renamed into place when one is ready."""
        streams: dict[Stream, StreamOutput] = {}
        being_written = spools_being_written(state_dir)
        if call_id in being_written:
            raise FileExistsError(f"the spool of {call_id} is already being written")
        being_written.add(call_id)  # before the directory exists: see _BEING_WRITTEN
        try:
            # Else (or when it could not) the writers make the directory, as before.
            fresh = ready is not None and ready.take(call_id)
            for name in STREAMS:
                streams[name] = StreamOutput(
                    SpoolWriter(
                        stream_path(state_dir, call_id, name),
                        limits.spool_max_bytes,
                        on_truncated=None if on_truncated is None else functools.partial(on_truncated, name),
                        fresh_directory=fresh,
                    ),
                    LiveOutput(limits.throttle_ms, limits.max_chunk_bytes, limits.buffer_bytes),
                    budget=budget,
                )
        except BaseException:
            for stream in streams.values():
                stream.spool.close()
            being_written.discard(call_id)
            raise
        return cls(call_id, streams, journal, telemetry, origin, being_written)

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
        """Close both spools (recording their final state); from then on a prune may take
        them. Idempotent."""
        for stream in self.streams.values():
            stream.spool.close()
        if self._being_written is not None:
            self._being_written.discard(self.call_id)

    # --- the tasks --------------------------------------------------------------------------

    async def pump(self, pipes: Mapping[Stream, trio.abc.ReceiveStream]) -> None:
        """Read both pipes to their end and journal the live views, until the call has
        completed and both pipes are drained. However it ends, the spools are closed and
        `finished` is set."""
        try:
            if set(pipes) != set(self.streams):
                raise ValueError(f"pump needs one pipe per stream {STREAMS}")
            async with trio.open_nursery() as nursery:
                self._pump_nursery = nursery
                for name in STREAMS:
                    nursery.start_soon(self._read, name, pipes[name])
            self._pump_nursery = None
            # Both pipes are closed. A command that printed nothing had no flusher (`_take`
            # starts it with the first bytes read); the pump still ends only once the call
            # has completed, as the flusher made it: until then `finished` stays unset and
            # the spool stays registered as being written, so no prune takes it.
            if not self._flushing:
                await self._drained.wait()
        finally:
            self.finished.set()
            self.close()

    async def _read(self, name: Stream, pipe: trio.abc.ReceiveStream) -> None:
        stream = self.streams[name]
        try:
            if isinstance(pipe, trio.lowlevel.FdStream):
                await self._read_fd(stream, pipe.fileno())
            else:
                while data := bytes(await pipe.receive_some(READ_CHUNK_BYTES)):
                    await self._take(stream, data)
        finally:
            stream.closed = True
            stream.spool.close()
            if isinstance(pipe, trio.lowlevel.FdStream):
                # Closed at once: aclose would add a scheduler pass per pipe (two per
                # command) for a close that cannot block.
                pipe.close()
            else:
                await trio.aclose_forcefully(pipe)
            if all(s.closed for s in self.streams.values()):
                self.closed.set()
                self._wake.set()
                self._check_drained()

    async def _read_fd(self, stream: StreamOutput, fd: int) -> None:
        """FdStream.receive_some's loop without its costs per read: the bytes land in this
        thread's reused buffer (`_read_buffer`) instead of a new object, a short read (the
        pipe is drained) waits for the pipe at once instead of reading EAGAIN first, and a
        full one is followed by the next read without a pass of the scheduler, up to
        DRAIN_BYTES_PER_CHECKPOINT. The same errors as receive_some's."""
        view = _read_buffer()
        # No checkpoint before the first read: the task was just started (a pass of the
        # event loop already), and a command that has ended (or printed) is read at once,
        # which for a short command is all its reader does.
        since_checkpoint = 0
        while True:
            try:
                count = os.readv(fd, [view])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                since_checkpoint = 0
                continue
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    raise trio.ClosedResourceError("file was already closed") from None
                raise trio.BrokenResourceError from exc
            if not count:
                return
            # The buffer is reused by the next read (of any stream): _take uses it only
            # until its first await, and copies it before one.
            await self._take(stream, view[:count])
            since_checkpoint += count
            if count < len(view):
                await trio.lowlevel.wait_readable(fd)  # most likely empty now: wait for more
                since_checkpoint = 0
            elif since_checkpoint >= DRAIN_BYTES_PER_CHECKPOINT:
                await trio.lowlevel.checkpoint()
                since_checkpoint = 0

    async def _take(self, stream: StreamOutput, data: bytes | memoryview) -> None:
        """Keep one read's bytes: spool, summary, live view. Awaits only for a prune, and
        `data` is used only before that (a view of the shared read buffer is copied first)."""
        budget = stream.budget
        # (A stream that already drops everything keeps nothing: no room to make.)
        if budget is not None and budget.bytes + len(data) > budget.prune_at and not stream.spool.truncated:
            # Past the cap: first delete finished spools to make room for these bytes, then
            # keep them (or what fits, when the budget is full). The reader waits for the
            # prune, so nothing passes the cap while the disk is scanned.
            data = bytes(data)  # the shared read buffer is another reader's while this waits
            await budget.prune(need=len(data))
        kept = stream.feed(data)
        if self._telemetry is not None:
            self._telemetry.output_spooled(kept)
        self._wake.set()
        if not self._flushing and self._pump_nursery is not None:
            # The first bytes: from now on there is a live view to emit. Most commands an
            # agent runs print something, but many print nothing, and then this task (its
            # start and its three passes of the event loop) is never paid for.
            self._flushing = True
            self._pump_nursery.start_soon(self._flush_live)

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


_thread_local = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer (the event loop's): every command's readers read into it in
    turn, each using the bytes before its next await, so reading costs no allocation per
    read nor per command. An anonymous mapping, not a bytearray: its pages become memory
    only as reads reach them (commands that print little touch one)."""
    view: memoryview | None = getattr(_thread_local, "view", None)
    if view is None:
        view = _thread_local.view = memoryview(mmap.mmap(-1, READ_CHUNK_BYTES))
    return view


def spool_in_use(state_dir: str | os.PathLike[str], call_id: str) -> bool:
    """What the spool itself says about a writer that may still add to it: a held process's
    holder that has not recorded its end (its `spec.json` without an `exit.json`), or a stream
    file whose state is not `ended`. A stream that has no file yet says nothing: a command
    that has written nothing is known only to the process that runs it."""
    directory = spool_dir(state_dir, call_id)
    if (directory / SPEC_FILE).exists() and not (directory / EXIT_FILE).exists():
        return True
    for name in STREAMS:
        path = stream_path(state_dir, call_id, name)
        if path.exists():
            state = read_state(path)
            if state is None or not state.ended:
                return True
    return False


def prune_finished_spools(
    state_dir: str | os.PathLike[str], cap_bytes: int, keep: Container[str]
) -> tuple[list[str], int]:
    """Delete finished commands' spools, oldest (by last write) first, until all spools fit in
    `cap_bytes`; (call ids removed, bytes left). Never a spool in `keep` (asked right before
    each deletion, so a live container covers commands that started during the scan), nor one
    that is still in use on disk (`spool_in_use`): when the running commands alone pass the
    cap, they are all kept and the total stays above it until they finish."""
    usage = spool_usage(state_dir)
    total = sum(u.bytes for u in usage)
    removed = []
    for item in usage:
        if total <= cap_bytes:
            break
        if item.call_id in keep or spool_in_use(state_dir, item.call_id):
            continue
        remove_spool(state_dir, item.call_id)
        removed.append(item.call_id)
        total -= item.bytes
    return removed, total


class _Kept:
    """What a prune must keep: the spools the caller named, and those being written now."""

    def __init__(self, named: set[str], being_written: set[str]) -> None:
        self._named = named
        self._being_written = being_written

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._named or call_id in self._being_written


# SpoolBudget's limit while there is room: a write never compares above it.
NO_LIMIT = sys.maxsize
# A prune that makes room for a write frees this fraction of the cap more than the write
# needs: a command printing on at the cap then costs a disk scan per cap/16 bytes, not one
# per pipe read (each would delete just enough for that read).
PRUNE_SLACK_DIVISOR = 16


class SpoolBudget:
    """The bytes in all spools against `exec.spool_total_max_bytes`.

    Tracked in memory so that the cap is checked without scanning the disk on every write:
    measured at start and by every prune, and counted up by the commands' writers
    (`StreamOutput.feed`) as they keep bytes. Held processes' holders (and a previous
    daemon's command host) write their spools themselves: those bytes are only seen by the
    next prune's scan.

    When a write would take the total past the cap, the writer first waits for a prune,
    which deletes the oldest finished spools until the write fits. One prune runs at a
    time: a request while one runs is folded into it (it scans once more if the total is
    still over the cap) and waits for it, so two passes never race to delete the same spool.

    When a prune leaves no room for the write, what is left is only what it may not take
    (running commands, held processes): the budget is *full*. The writers then keep nothing
    past the cap (`limit`), dropping and counting the rest as past a stream's own cap, and
    stop asking for prunes; the next prune (the shell asks for one whenever a command ends
    while full: its spool becomes prunable) that leaves the total under the cap lifts the
    limit again, for the streams that have not dropped anything.
    """

    def __init__(self, state_dir: Path, cap_bytes: int, keep: Callable[[], set[str]] = set) -> None:
        self.state_dir = state_dir
        self.cap_bytes = cap_bytes
        self.bytes = sum(u.bytes for u in spool_usage(state_dir))
        # What a prune must keep besides the spools being written (`_BEING_WRITTEN`): the
        # shell's running commands and the spools held processes' holders write.
        self._keep = keep
        # Writers keep bytes while the total stays at most `limit`, and ask for a prune past
        # `prune_at`: one of them is the cap, the other NO_LIMIT, by whether it is full.
        self.limit = NO_LIMIT
        self.prune_at = cap_bytes
        self._being_written = spools_being_written(state_dir)
        self._pruning = False
        self._idle = trio.Event()  # set when the running prune (and what it took over) ends
        # The `keep` of a request that arrived while a prune ran (the newest one wins: it
        # knows every command the older ones knew that still runs).
        self._requested: set[str] | None = None
        self._need = 0  # the most room a request folded into the running prune wants
        self._bytes_at_scan = 0

    @property
    def full(self) -> bool:
        """The last prune left the spools it may not take over the cap."""
        return self.limit != NO_LIMIT

    @property
    def over_cap(self) -> bool:
        return self.bytes > self.cap_bytes

    async def prune(self, keep: set[str] | None = None, *, need: int = 0) -> None:
        """Delete the oldest finished spools not in `keep` (default: the budget's `keep()`)
        until all fit under the cap with `need` bytes more (`prune_finished_spools`), in a
        worker thread; the count is then the disk's, and the budget is `full` when the
        `need` bytes do not fit. When a prune is already running, that one takes this
        request over, and this waits for it."""
        self._requested = set(self._keep() if keep is None else keep)
        self._need = max(self._need, need)
        if self._pruning:
            await self._idle.wait()
            return
        self._pruning = True
        self._idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):  # a half-done prune would only be redone
                while self._requested is not None:
                    keep, self._requested = self._requested, None
                    need, self._need = self._need, 0
                    await self._prune_once(keep, need)
                    if self.bytes + need <= self.cap_bytes:
                        self._requested = None
        finally:
            self._pruning = False
            self._need = 0
            self._idle.set()

    async def _prune_once(self, keep: set[str], need: int) -> None:
        self._bytes_at_scan = self.bytes
        kept = _Kept(keep, self._being_written)
        slack = self.cap_bytes // PRUNE_SLACK_DIVISOR if need else 0
        target = max(0, self.cap_bytes - need - slack)
        try:
            removed, left = await trio.to_thread.run_sync(prune_finished_spools, self.state_dir, target, kept)
        except OSError:
            log.exception("spool.prune_failed")
            return
        # Bytes counted while the thread scanned may or may not be in what it saw: counted
        # again, which errs towards the next prune coming early, never towards the cap.
        self.bytes = left + max(0, self.bytes - self._bytes_at_scan)
        if removed:
            log.info("spool.pruned", calls=len(removed), bytes_left=self.bytes)
        was_full, full = self.full, self.bytes + need > self.cap_bytes
        self.limit, self.prune_at = (self.cap_bytes, NO_LIMIT) if full else (NO_LIMIT, self.cap_bytes)
        if full and not was_full:
            log.warning("spool.full", bytes=self.bytes, cap_bytes=self.cap_bytes)
        elif was_full and not full:
            log.info("spool.room", bytes=self.bytes, cap_bytes=self.cap_bytes)
