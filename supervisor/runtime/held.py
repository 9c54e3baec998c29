"""Processes kept by a holder (docs/protocol.md §7.7): start, stdin, terminal, list, adoption.

A `start_process` call starts a holder (runtime/holder.py), a small process of the daemon's
user that owns the process's pipes or terminal, writes its output into the spool and records
its exit durably. The daemon is only a reader: this module connects to each holder's control
socket, turns what the spool gained into throttled `exec.output` events, forwards stdin,
resizes and signals, and journals `exec.completed` once. Nothing of the process depends on
the daemon being alive, so a restarted daemon adopts every holder it finds running (`adopt`)
and reports the exit of one that ended meanwhile from its exit record: exactly once, because
the exit is journaled in the transaction that marks the record ended.

Where the live view stands is recorded with each batch of events (`held.*_sent`, in the same
transaction), so an adopted process's events continue after the last journaled byte: none
twice, none skipped (a gap would show as the next event's offset, as for any dropped bytes).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.daemon import fd_wait
from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.fields import STREAMS, Stream
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED
from sandbox_supervisor.daemon.runtime.command_output import CLOCK_EPSILON_S, OutputLimits, output_event
from sandbox_supervisor.daemon.runtime.cgroups import CommandCgroup
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    ExitRecord,
    HolderProtocolError,
    LineSplitter,
    Message,
    Reply,
    control_socket_path,
    decode_message,
    read_exit,
)
from sandbox_supervisor.daemon.runtime.output import LiveOutput
from sandbox_supervisor.daemon.runtime.tools.execute_shell_command import summarize_spooled
from sandbox_supervisor.daemon.runtime.processes import read_stat
from sandbox_supervisor.daemon.runtime.spool import read_state, spool_dir, stream_path
from sandbox_supervisor.daemon.state.store import HeldRecord, StateStore, StoreError

log = structlog.get_logger("supervisor.held")

READ_CHUNK_BYTES = 64 * 1024
# How long a request to a holder may take before the daemon gives up on that answer: a holder
# answers from memory, so only a wedged one is this slow.
HOLDER_REPLY_TIMEOUT_S = 5.0
# A terminal's output is sent as it comes, not at most once per exec.output_throttle_ms: it
# is what a person types and waits to see echoed (a keystroke's round trip), and what a
# terminal program redraws. Heavy output still travels in chunks of output_max_chunk_bytes.
TERMINAL_THROTTLE_MS = 0.0
# After the process exited, descendants in the background may still be writing: its
# exec.completed waits this long for the streams to end, as a command's does (§7.4.3).
COMPLETION_GRACE_S = 0.2
# The spool files of a process on a terminal: its output is one stream (docs/protocol.md).
TERMINAL_STREAMS: tuple[Stream, ...] = ("stdout",)


class HolderGone(Exception):
    """The holder's control connection is closed (the holder ended, or was killed)."""


class HolderSlow(Exception):
    """The holder did not answer within HOLDER_REPLY_TIMEOUT_S (it may still; the link drops
    that late answer)."""


class HolderLink:
    """One control connection to a holder (holder_protocol.py): requests answered in order,
    events passed to a callback. One request at a time (a lock), so the next reply is always
    the answer to the request in flight.

    The socket is a plain non-blocking one, read and written directly and waited on with
    trio's wait_readable/wait_writable only when it must be: each keystroke crosses this link
    twice, and trio's socket stream would add a failed read per message and a scheduler pass
    per send (its checkpoints) to the daemon's work for it."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = trio.Lock()
        self._reply_send, self._reply_receive = trio.open_memory_channel[Reply](1)
        self.closed = trio.Event()
        # Requests given up on whose answers have not come yet: answers come in request order,
        # so the next this many are theirs and are dropped, not taken for a later request's.
        self._abandoned = 0
        # The rest of a request line a cancellation cut short (_send_all): written before
        # the next request's line.
        self._unsent = b""

    @classmethod
    def connect(cls, directory: Path) -> HolderLink:
        """Connect through a descriptor of the holder's directory: its socket's path may be
        longer than a unix socket address holds. A unix socket's connect is done or refused
        at once (a full backlog is `BlockingIOError`, an OSError like the others: the caller
        asks again), so nothing here waits."""
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            try:
                sock.connect(control_socket_path(fd))
            except BaseException:
                sock.close()
                raise
        finally:
            os.close(fd)
        return cls(sock)

    async def request(self, line: bytes) -> Reply:
        try:
            # A free lock is taken without a checkpoint (the usual case: one request at a
            # time): `async with` would yield to the scheduler first, one more pass of the
            # event loop on a keystroke's way to its terminal.
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            return await self._request_locked(line)
        finally:
            self._lock.release()

    async def _request_locked(self, line: bytes) -> Reply:
        if self.closed.is_set():
            raise HolderGone()
        await self._send_all(line)
        try:
            with trio.move_on_after(HOLDER_REPLY_TIMEOUT_S):
                try:
                    return await self._reply_receive.receive()
                except trio.EndOfChannel:
                    raise HolderGone() from None
        except trio.Cancelled:
            # The requester's own end (its socket superseded or closed while the holder was
            # slow): the holder has the request and answers it all the same, and that answer
            # must not be taken for the next request's (every later answer would be one off).
            with contextlib.suppress(trio.EndOfChannel):
                self._give_up_reply()
            raise
        try:
            self._give_up_reply()
        except trio.EndOfChannel:
            raise HolderGone() from None
        raise HolderSlow()

    def _give_up_reply(self) -> None:
        """Stop waiting for the answer to the request in flight: taken now if it came as the
        wait ended, else counted, so the reader drops it when it comes. EndOfChannel: the
        link is gone."""
        try:
            self._reply_receive.receive_nowait()
        except trio.WouldBlock:
            self._abandoned += 1

    async def _send_all(self, line: bytes) -> None:
        """Write the whole line, waiting only while the socket is full (a request is a line
        of at most MAX_LINE_BYTES; the holder reads them as they come).

        A line that a cancellation cut short is finished first: the holder has its start, and
        any other bytes after it would make one garbled line of two requests (the cut one's
        stdin lost, the next one answered with an error). Its answer is given up on."""
        data = self._unsent + line if self._unsent else line
        own_start = len(data) - len(line)  # where this request's line begins in `data`
        self._unsent = b""
        view = memoryview(data)
        sent = 0
        try:
            while sent < len(data):
                try:
                    sent += self._sock.send(view[sent:])
                except BlockingIOError:
                    try:
                        await fd_wait.wait_writable(self._sock)
                    except trio.ClosedResourceError:
                        raise HolderGone() from None
                except OSError:  # EPIPE, ECONNRESET: the holder is gone; EBADF: the link closed
                    raise HolderGone() from None
        except trio.Cancelled:
            if sent > own_start:
                # This request's line is begun: the holder answers it once it is whole.
                self._unsent = data[sent:]
                self._abandoned += 1
            else:
                self._unsent = data[sent:own_start]  # the earlier line's rest, if any
            raise

    async def run(self, on_event: Callable[[Message], None]) -> None:
        """Read the holder's lines until it closes the connection (or says something the
        protocol does not allow: then the link is dropped, and the spool and exit record
        still tell what happened)."""
        splitter = LineSplitter()
        try:
            while True:
                try:
                    # Waited on first: after the previous message the socket is nearly always
                    # empty, and a read to learn that is a system call for nothing.
                    await fd_wait.wait_readable(self._sock)
                    data = self._sock.recv(READ_CHUNK_BYTES)
                except BlockingIOError:
                    continue
                except (OSError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                messages: Sequence[Message] = [decode_message(line) for line in splitter.feed(data)]
                replies = [message for message in messages if isinstance(message, Reply)]
                if replies and len(replies) < len(messages):
                    # A reply and events came in one read (a keystroke's answer and its echo):
                    # the events first, the reply one scheduler batch later. The socket's
                    # sender, woken as the events are journaled, then writes the echo before
                    # the requester's turn makes the exec.stdin_ack, which follows in a write
                    # of its own. Handed over in the same batch, the requester would run
                    # before the sender about half the time, and the echo would wait for it.
                    for message in messages:
                        if not isinstance(message, Reply):
                            on_event(message)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    messages = replies
                for message in messages:
                    if isinstance(message, Reply):
                        if self._abandoned:
                            self._abandoned -= 1  # the late answer to a request given up on
                        else:
                            try:
                                # The requester waits for it: handed over without a
                                # scheduler pass of this task's own.
                                self._reply_send.send_nowait(message)
                            except trio.WouldBlock:
                                await self._reply_send.send(message)
                    else:
                        on_event(message)
        except HolderProtocolError:
            log.warning("holder.protocol_error", exc_info=True)
        finally:
            self.closed.set()
            self._reply_send.close()

    async def aclose(self) -> None:
        self.close_now()
        await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """Close the socket without a checkpoint (aclose's first half)."""
        trio.lowlevel.notify_closing(self._sock)  # a task waiting on it gets ClosedResourceError
        self._sock.close()


@dataclass(eq=False)
class HeldProcess:
    """One process kept by a holder, as the daemon tends it."""

    record: HeldRecord
    directory: Path
    limits: OutputLimits
    link: HolderLink | None = None
    # Where the daemon has read each spool file to, and the live views fed from there.
    read_to: dict[Stream, int] = field(default_factory=dict)
    live: dict[Stream, LiveOutput] = field(default_factory=dict)
    exit: ExitRecord | None = None  # exit.json, once the process exited
    cgroup: CommandCgroup | None = None  # its own cgroup (runtime/cgroups.py), when there are any
    wake: trio.Event = field(default_factory=trio.Event)
    _files: dict[Stream, int] = field(default_factory=dict)  # the spool files, open for reading
    ended: trio.Event = field(default_factory=trio.Event)  # exec.completed journaled
    # Set once the tending task's connect to the holder is over (`link` set, or the holder
    # known gone): what a request right after the start waits for.
    linked: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        for name in STREAMS:
            start = self.record.sent.get(name, 0)
            throttle = TERMINAL_THROTTLE_MS if self.record.pty else self.limits.throttle_ms
            live = LiveOutput(throttle, self.limits.max_chunk_bytes, self.limits.buffer_bytes)
            live.skip_to(start)
            self.live[name] = live
            self.read_to[name] = start

    @property
    def call_id(self) -> str:
        return self.record.call_id

    def read_new(self) -> bool:
        """Feed the live views what the spool files gained since the last read. Each file is
        opened once, when it exists (a stream's file comes with its first byte), and read by
        offset: this runs for every batch a process writes (a keystroke's echo, in a terminal)."""
        gained = False
        # A terminal is one stream (stdout): its holder never makes a stderr file, and
        # looking for one would cost a failed open on every keystroke's echo.
        for name in TERMINAL_STREAMS if self.record.pty else STREAMS:
            fd = self._files.get(name)
            if fd is None:
                try:
                    fd = self._files[name] = os.open(self.directory / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
            while data := os.pread(fd, READ_CHUNK_BYTES, self.read_to[name]):
                self.live[name].feed(data)
                self.read_to[name] += len(data)
                gained = True
                if len(data) < READ_CHUNK_BYTES:
                    break  # a short read of a file is its end, for now: no read to learn it
        return gained

    def close_files(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def sent(self) -> dict[str, int]:
        """The stream offsets up to which events are built (fed and flushed)."""
        return {name: live.fed - live.buffered for name, live in self.live.items()}

    def read_exit(self) -> ExitRecord | None:
        try:
            return read_exit(self.directory)
        except HolderProtocolError:
            # A damaged exit record (a crash mid-write is ruled out: it is renamed into
            # place): reported like a holder that died without one.
            log.warning("holder.bad_exit_record", call_id=self.call_id)
            return None


def holder_alive(record: HeldRecord) -> bool:
    stat = read_stat(record.holder_pid)
    return stat is not None and stat.start_ticks == record.holder_start_ticks and stat.state != "Z"


def completed_body(process: HeldProcess, exit: ExitRecord | None) -> dict[str, Any]:
    """exec.completed for a held process: its real exit, or `interrupted` when its holder
    died without recording one."""
    summaries: dict[str, dict[str, Any]] = {}
    for name in STREAMS:
        path = process.directory / name
        state = read_state(path) if path.exists() else None
        summaries[name] = (
            summarize_spooled(path, state.truncated, state.total)
            if state is not None
            else summarize_spooled(path, False, path.stat().st_size)
            if path.exists()
            else {"bytes": 0, "head": "", "tail": "", "truncated": False}
        )
    if exit is None:
        return {
            "call_id": process.call_id,
            "exit_code": None,
            "signal": None,
            "timed_out": False,
            "duration_ms": int(max(0.0, time.time() - process.record.started_at) * 1000),
            **summaries,
            "interrupted": True,
        }
    return {
        "call_id": process.call_id,
        "exit_code": exit.exit_code,
        "signal": exit.signal,
        "timed_out": exit.timed_out,
        "duration_ms": exit.duration_ms,
        **summaries,
        "interrupted": False,
    }


__all__ = [
    "COMPLETION_GRACE_S",
    "HeldProcess",
    "HolderGone",
    "HolderSlow",
    "HolderLink",
    "completed_body",
    "holder_alive",
]
