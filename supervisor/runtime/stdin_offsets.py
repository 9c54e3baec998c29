"""A process's stdin addressed by byte offset: the rules, with no I/O (docs/internals.md, "The holder").

The client (the daemon, for the agent) numbers every byte it sends to a process's stdin from
0. A write names the offset of its first byte, so a write that is retried — after a lost
reply, a reconnection, a daemon restart — can never be written twice and never leave a hole:

- bytes below the current offset were already accepted: they are acknowledged, not written
  again (a retry that overlaps the end writes only its new suffix);
- a write that starts above the current offset would leave a gap: it is refused with the
  offset expected (`StdinGap`), and the client resends from there;
- only what fits the bounded buffer is accepted; the answer (`next`) is the offset after the
  last byte accepted, and the client sends the rest later from there. A process that never
  reads therefore costs the holder at most `capacity` bytes, whatever the client sends.

`close(offset)` asks for end-of-file once every byte below `offset` is written; the offset
must be the current one (the client knows everything it sent was accepted), else `StdinGap`.
It is idempotent. The holder carries the decisions out: it writes `pending()` to the
descriptor, reports what went with `written(n)`, and closes the descriptor once `eof_due`.

Stdlib only: the per-process holder runs this (it imports neither pydantic nor trio).
"""

from __future__ import annotations

__all__ = ["DEFAULT_STDIN_BUFFER_BYTES", "StdinClosed", "StdinGap", "StdinOffsets"]

# What a holder keeps of a process's stdin that the process has not read yet (beyond what
# the kernel's pipe or terminal buffer holds). Enough to keep a fast reader busy between two
# client writes; small enough that a thousand processes that never read cost little.
DEFAULT_STDIN_BUFFER_BYTES = 64 * 1024


class StdinGap(Exception):
    """A write or close at an offset other than the one expected; resend from `expected`."""

    def __init__(self, expected: int) -> None:
        super().__init__(f"stdin continues at offset {expected}")
        self.expected = expected


class StdinClosed(Exception):
    """Stdin was closed (by `close`, or the reader went away): nothing more is accepted."""


class StdinOffsets:
    """The accepted offset, the bytes accepted but not yet written, and the close request."""

    def __init__(self, capacity: int = DEFAULT_STDIN_BUFFER_BYTES) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._buffer = bytearray()
        self._next = 0  # offset after the last byte accepted
        self._close_requested = False
        self._broken = False  # the reader went away: what is buffered will never be read

    @property
    def next(self) -> int:
        """The offset the next new byte must have: everything below it was accepted."""
        return self._next

    @property
    def written(self) -> int:
        """Bytes handed to the process (accepted and no longer buffered)."""
        return self._next - len(self._buffer)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def closed(self) -> bool:
        """No byte is accepted any more (close requested, or the reader is gone)."""
        return self._close_requested or self._broken

    @property
    def eof_due(self) -> bool:
        """Close was requested and every accepted byte is written: close the descriptor now."""
        return self._close_requested and not self._buffer

    def offer(self, offset: int, data: bytes) -> int:
        """Accept what is new in `data` (whose first byte has `offset`) and fits; the new `next`.

        Raises StdinGap when `offset` is above `next`, StdinClosed after a close. A write
        entirely below `next` is a retry already accepted: answered, and nothing is added.
        """
        if offset < 0:
            raise ValueError("offset must not be negative")
        if offset > self._next:
            if self.closed:
                raise StdinClosed()
            raise StdinGap(self._next)
        new = memoryview(data)[self._next - offset :]
        if not new:
            return self._next  # a retry of bytes already accepted (or an empty write)
        if self.closed:
            raise StdinClosed()
        taken = new[: self._capacity - len(self._buffer)]
        self._buffer += taken
        self._next += len(taken)
        return self._next

    def close(self, offset: int) -> None:
        """Ask for end-of-file after every byte below `offset`, which must be `next`."""
        if offset != self._next:
            raise StdinGap(self._next)
        self._close_requested = True

    def pending(self) -> bytes:
        """Accepted bytes still to write, oldest first."""
        return bytes(self._buffer)

    def written_out(self, count: int) -> None:
        """`count` bytes of `pending()` reached the process."""
        if not 0 <= count <= len(self._buffer):
            raise ValueError("more bytes written than were pending")
        del self._buffer[:count]

    def reader_gone(self) -> None:
        """The process closed its stdin (EPIPE) or ended: drop the buffer, accept nothing more."""
        self._broken = True
        self._buffer.clear()
