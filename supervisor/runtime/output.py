"""What a client sees of a command's output: live (docs/protocol.md §7.4.4) and in its result (§7.4.3).

`LiveOutput` is the live view of one stream of one process: bytes are fed as they arrive, and
the shell task asks when the next `exec.output` event is due and takes its chunks. It is lossy
by design: when a client cannot keep up, or a command prints faster than the throttle lets
events out, the oldest buffered bytes are dropped and the next event says how many
(`truncated`, `dropped_bytes`). The spool (spool.py) has every byte, and the event offsets say
exactly which range to fetch from it.

`StreamHeadTail` keeps what the result needs: the first and last 8 KiB and the byte count.

Both are plain objects over bytes and caller-supplied times (milliseconds, any monotonic
origin): no clock, no trio, no I/O.

Decisions:
- Throttle: a flush is due when there is something to send and `throttle_ms` has passed since
  the previous flush that sent something (leading edge: the first output goes out at once).
- A non-final flush emits at most ONE chunk of at most `max_chunk_bytes`, so at most one event
  per stream per window. What is left stays buffered for the next window and, when the buffer
  overflows, its oldest bytes are dropped. A final flush (before `exec.completed`, and at the
  end of the pipe) ignores the throttle and emits everything left, as several capped chunks.
  A final flush does not close the view: a background descendant may still write (after_exit).
- UTF-8: a chunk never ends inside a character. An incomplete sequence at the end of the buffer
  (at most 3 bytes) is held back until more bytes arrive or a final flush sends it as it is.
  Invalid bytes are sent as they are and decoded with U+FFFD in `text`. When dropping the
  oldest bytes would start the buffer inside a character, its continuation bytes (at most 3)
  are dropped too, and counted.
- `offset` is the stream offset of a chunk's first byte, so for consecutive chunks
  `offset = previous.offset + len(previous.data) + dropped_bytes`; `truncated` is
  `dropped_bytes > 0`. A drop always leaves bytes behind (the buffer holds at least a chunk,
  hence at least 4 bytes, and at most 3 orphans go), so every drop is reported by a chunk and,
  after a final flush, sum of chunk sizes + sum of dropped_bytes = bytes fed.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HEAD_TAIL_BYTES",
    "LiveOutput",
    "OutputChunk",
    "StreamHeadTail",
    "held_back",
]

# The longest UTF-8 character: a chunk must be able to hold one whole.
MAX_CHARACTER_BYTES = 4
# Head and tail of a stream in the result (docs/protocol.md §7.4.3).
HEAD_TAIL_BYTES = 8 * 1024
_REPLACE = "replace"
_NEVER = -math.inf


def _is_continuation(byte: int) -> bool:
    return byte & 0b1100_0000 == 0b1000_0000


def held_back(data: bytes | bytearray) -> int:
    """How many bytes at the end of `data` start a character that is not complete yet (0–3).

    Exactly what a UTF-8 decoder would hold back: a valid but unfinished sequence. Only the
    last three bytes can hold one, and the bytes before them cannot change the answer.
    """
    if not data or data[-1] < 0x80:
        return 0  # ends in ASCII (or nothing): no character is left open (the usual case)
    decoder = codecs.getincrementaldecoder("utf-8")(_REPLACE)
    decoder.decode(bytes(data[-(MAX_CHARACTER_BYTES - 1) :]), final=False)
    pending, _ = decoder.getstate()
    return len(pending)


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One `exec.output` event's worth of one stream."""

    offset: int  # stream offset of data[0]
    data: bytes
    text: str  # data decoded as UTF-8 with replacement
    truncated: bool  # bytes were dropped just before this chunk
    dropped_bytes: int  # how many, since the previous chunk
    after_exit: bool  # written by a background descendant after the shell exited

    def event_body(self, call_id: str, stream: str) -> dict[str, Any]:
        """The `exec.output` body (protocol.frames.ExecOutputBody)."""
        return {
            "call_id": call_id,
            "stream": stream,
            "text": self.text,
            "offset": self.offset,
            "bytes": len(self.data),
            "truncated": self.truncated,
            "dropped_bytes": self.dropped_bytes,
            "after_exit": self.after_exit,
        }


class LiveOutput:
    """The throttled, capped, bounded live view of one stream (see the module docstring)."""

    def __init__(self, throttle_ms: float, max_chunk_bytes: int, buffer_bytes: int) -> None:
        if throttle_ms < 0:
            raise ValueError("throttle_ms must not be negative")
        if max_chunk_bytes < MAX_CHARACTER_BYTES:
            raise ValueError(f"max_chunk_bytes must hold a whole character ({MAX_CHARACTER_BYTES})")
        if buffer_bytes < max_chunk_bytes:
            raise ValueError("buffer_bytes must be at least max_chunk_bytes")
        self._throttle_ms = throttle_ms
        self._max_chunk = max_chunk_bytes
        self._capacity = buffer_bytes
        self._buffer = bytearray()
        self._offset = 0  # stream offset of _buffer[0]
        self._dropped = 0  # since the previous chunk
        self._last_flush_ms = _NEVER

    @property
    def fed(self) -> int:
        """Bytes fed so far (the stream's length)."""
        return self._offset + len(self._buffer)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def skip_to(self, offset: int) -> None:
        """Start the view at `offset` (bytes before it were sent by an earlier daemon: a
        held process adopted after a restart). Only before anything was fed."""
        if self.fed:
            raise ValueError("skip_to before the first feed only")
        self._offset = offset

    def feed(self, data: bytes | memoryview) -> None:
        """`data` is used only during the call (the reader passes a view of its buffer)."""
        if not data:
            return
        dropped_before = self._dropped
        if len(data) >= self._capacity:
            # Only the newest `capacity` bytes can stay: drop the whole buffer and the head of
            # data without copying them in first.
            self._drop(len(self._buffer))
            skipped = len(data) - self._capacity
            self._offset += skipped
            self._dropped += skipped
            self._buffer = bytearray(data[skipped:])
        else:
            self._buffer += data
            if len(self._buffer) > self._capacity:
                self._drop(len(self._buffer) - self._capacity)
        if self._dropped > dropped_before:
            self._drop(self._orphans())

    def _orphans(self) -> int:
        """Continuation bytes at the start of the buffer after a drop: their lead byte is gone."""
        count = 0
        while (
            count < MAX_CHARACTER_BYTES - 1
            and count < len(self._buffer)
            and _is_continuation(self._buffer[count])
        ):
            count += 1
        return count

    def _drop(self, count: int) -> None:
        del self._buffer[:count]
        self._offset += count
        self._dropped += count

    def _sendable(self) -> int:
        """Bytes a non-final flush could send: all but an unfinished trailing character."""
        return len(self._buffer) - held_back(self._buffer)

    def due(self, now_ms: float) -> bool:
        return self._sendable() > 0 and now_ms - self._last_flush_ms >= self._throttle_ms

    def next_flush_at(self) -> float | None:
        """When a flush becomes due (-inf: already), or None while there is nothing to send."""
        if self._sendable() == 0:
            return None
        return self._last_flush_ms + self._throttle_ms

    def flush(
        self, now_ms: float, *, final: bool = False, after_exit: bool = False
    ) -> list[OutputChunk]:
        """The chunks to send now.

        Not final: one chunk of at most max_chunk_bytes when due(now_ms), otherwise none.
        Final: everything left, as chunks of at most max_chunk_bytes, whatever the throttle.
        """
        if not final:
            if not self.due(now_ms):
                return []
            chunks = [self._take(self._chunk_length(final=False), after_exit)]
        else:
            chunks = []
            while self._buffer:
                chunks.append(self._take(self._chunk_length(final=True), after_exit))
        if chunks:
            self._last_flush_ms = now_ms
        return chunks

    def _chunk_length(self, *, final: bool) -> int:
        if final and len(self._buffer) <= self._max_chunk:
            return len(self._buffer)  # the end: an unfinished character goes out as it is
        candidate = min(len(self._buffer), self._max_chunk)
        # max_chunk >= 4 > held_back, so a chunk is never empty.
        return candidate - held_back(self._buffer[:candidate])

    def _take(self, length: int, after_exit: bool) -> OutputChunk:
        data = bytes(self._buffer[:length])
        del self._buffer[:length]
        chunk = OutputChunk(
            offset=self._offset,
            data=data,
            text=data.decode("utf-8", _REPLACE),
            truncated=self._dropped > 0,
            dropped_bytes=self._dropped,
            after_exit=after_exit,
        )
        self._offset += length
        self._dropped = 0
        return chunk


class StreamHeadTail:
    """The `{"bytes","head","tail","truncated"}` summary of a stream in the result (§7.4.3).

    head: the first 8 KiB; tail: the last 8 KiB that are not already in the head, so the two
    never overlap: for output up to 8 KiB the tail is "", up to 16 KiB head + tail is all of it,
    beyond that the bytes between them are only in the spool. Both are cut at character
    boundaries (so each may be up to 3 bytes short of 8 KiB) and decoded with replacement.
    `bytes` counts every byte the stream produced, also those past the spool cap.
    """

    def __init__(self, limit: int = HEAD_TAIL_BYTES) -> None:
        self._limit = limit
        self._head = bytearray()
        # The tail keeps a few extra bytes so its start can be moved to a character boundary.
        self._tail_keep = limit + MAX_CHARACTER_BYTES - 1
        self._tail = bytearray()
        self._total = 0

    def feed(self, data: bytes | memoryview) -> None:
        """`data` is used only during the call, as in LiveOutput.feed."""
        if len(self._head) < self._limit:
            self._head += data[: self._limit - len(self._head)]
        self._total += len(data)
        if len(data) >= self._tail_keep:
            self._tail = bytearray(data[-self._tail_keep :])
        else:
            self._tail += data
            del self._tail[: max(0, len(self._tail) - self._tail_keep)]

    def summary(self, *, truncated: bool) -> dict[str, Any]:
        """protocol.tools.StreamSummary; `truncated` is the spool's (it hit its cap)."""
        if self._total <= self._limit:
            return {
                "bytes": self._total,
                "head": self._head.decode("utf-8", _REPLACE),
                "tail": "",
                "truncated": truncated,
            }
        head_end = self._limit - held_back(self._head)
        tail_start = max(head_end, self._total - self._limit)
        tail = self._tail[len(self._tail) - (self._total - tail_start) :]
        if tail_start > head_end:
            # Start at a character: step over the continuation bytes of one cut in two.
            skip = 0
            while skip < min(MAX_CHARACTER_BYTES - 1, len(tail)) and _is_continuation(tail[skip]):
                skip += 1
            tail = tail[skip:]
        return {
            "bytes": self._total,
            "head": self._head[:head_end].decode("utf-8", _REPLACE),
            "tail": bytes(tail).decode("utf-8", _REPLACE),
            "truncated": truncated,
        }
