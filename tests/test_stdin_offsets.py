"""The stdin offset rules (supervisor/runtime/stdin_offsets.py), as plain decisions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox_supervisor.daemon.runtime.stdin_offsets import StdinClosed, StdinGap, StdinOffsets


def test_new_bytes_are_accepted_and_retries_are_acknowledged_without_being_added():
    stdin = StdinOffsets(capacity=100)
    assert stdin.offer(0, b"abc") == 3
    assert stdin.offer(0, b"abc") == 3  # the same write again
    assert stdin.offer(2, b"cde") == 5  # overlaps: only "de" is new
    assert stdin.pending() == b"abcde"


def test_a_gap_is_refused_with_the_offset_expected():
    stdin = StdinOffsets(capacity=100)
    stdin.offer(0, b"abc")
    with pytest.raises(StdinGap) as gap:
        stdin.offer(4, b"x")
    assert gap.value.expected == 3
    assert stdin.pending() == b"abc"


def test_only_what_fits_the_buffer_is_accepted_and_more_fits_once_written():
    stdin = StdinOffsets(capacity=4)
    assert stdin.offer(0, b"abcdef") == 4
    assert stdin.offer(4, b"ef") == 4  # full
    stdin.written_out(3)
    assert (stdin.written, stdin.buffered) == (3, 1)
    assert stdin.offer(4, b"ef") == 6
    assert stdin.pending() == b"def"


def test_close_needs_the_current_offset_is_idempotent_and_waits_for_the_buffer():
    stdin = StdinOffsets(capacity=10)
    stdin.offer(0, b"ab")
    with pytest.raises(StdinGap) as gap:
        stdin.close(1)
    assert gap.value.expected == 2
    stdin.close(2)
    stdin.close(2)
    assert stdin.closed and not stdin.eof_due  # "ab" still to be written
    stdin.written_out(2)
    assert stdin.eof_due
    assert stdin.offer(0, b"ab") == 2  # a retry of accepted bytes is still answered
    with pytest.raises(StdinClosed):
        stdin.offer(2, b"c")
    with pytest.raises(StdinClosed):
        stdin.offer(5, b"c")  # past the end of a closed stdin: closed, not a gap


def test_a_reader_that_went_away_drops_the_buffer_and_refuses_more():
    stdin = StdinOffsets(capacity=10)
    stdin.offer(0, b"abc")
    stdin.reader_gone()
    assert stdin.pending() == b"" and stdin.closed
    with pytest.raises(StdinClosed):
        stdin.offer(3, b"d")


@given(
    st.lists(st.tuples(st.integers(0, 40), st.binary(max_size=12), st.integers(0, 12)), max_size=40),
    st.integers(1, 16),
)
def test_whatever_the_client_retries_the_process_reads_one_stream_without_holes_or_repeats(writes, capacity):
    """A client resending arbitrary (overlapping, stale, early) pieces of one byte stream:
    what reaches the process is always a prefix of that stream, and `next` never lies."""
    source = bytes(range(256)) * 2
    stdin = StdinOffsets(capacity=capacity)
    delivered = bytearray()
    for offset, piece, drain in writes:
        data = source[offset : offset + len(piece)]
        before = stdin.next
        try:
            after = stdin.offer(offset, data)
        except StdinGap as gap:
            assert offset > before and gap.expected == before
            after = before
        assert before <= after <= max(before, offset + len(data))
        chunk = stdin.pending()[:drain]
        stdin.written_out(len(chunk))
        delivered += chunk
        assert stdin.written == len(delivered)
        assert bytes(delivered) + stdin.pending() == source[: stdin.next]
