"""The live output view (docs/protocol.md §7.4.4) and the head/tail summary (§7.4.3), on a fake clock."""

from __future__ import annotations

import codecs
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.frames import ExecOutputBody
from sandbox_supervisor.protocol.tools import StreamSummary
from sandbox_supervisor.daemon.runtime.output import (
    HEAD_TAIL_BYTES,
    LiveOutput,
    OutputChunk,
    StreamHeadTail,
    held_back,
)

CALL_ID = "0b7f5d4e-8a43-4c6e-9a55-2f1f3d0c9b11"
THROTTLE = 150.0
EURO = "€".encode()  # 3 bytes
FACE = "😀".encode()  # 4 bytes


def view(throttle: float = THROTTLE, chunk: int = 4096, buffer: int = 65536) -> LiveOutput:
    return LiveOutput(throttle_ms=throttle, max_chunk_bytes=chunk, buffer_bytes=buffer)


def assert_chained(chunks: list[OutputChunk]) -> None:
    for previous, chunk in zip(chunks, chunks[1:]):
        assert chunk.offset == previous.offset + len(previous.data) + chunk.dropped_bytes


# --- throttle ---


def test_the_first_output_is_due_at_once() -> None:
    live = view()
    assert live.next_flush_at() is None
    live.feed(b"hello\n")
    assert live.next_flush_at() == -math.inf
    assert live.due(0.0)
    [chunk] = live.flush(0.0)
    assert (chunk.offset, chunk.data, chunk.text) == (0, b"hello\n", "hello\n")
    assert not chunk.truncated and chunk.dropped_bytes == 0 and not chunk.after_exit


def test_many_feeds_within_a_window_make_one_flush() -> None:
    live = view()
    live.feed(b"first\n")
    assert len(live.flush(1000.0)) == 1
    for step in range(1, 15):  # t = 1010 … 1140, all inside the window
        now = 1000.0 + 10 * step
        live.feed(b"line %d\n" % step)
        assert not live.due(now)
        assert live.flush(now) == []
    assert live.next_flush_at() == 1000.0 + THROTTLE
    assert live.due(1150.0)
    [chunk] = live.flush(1150.0)
    assert chunk.data == b"".join(b"line %d\n" % step for step in range(1, 15))
    assert chunk.offset == len(b"first\n")
    assert live.flush(1151.0) == []  # nothing left, and the window restarted anyway


def test_nothing_buffered_is_never_due() -> None:
    live = view()
    assert not live.due(10_000.0)
    assert live.flush(10_000.0) == []
    assert live.flush(10_000.0, final=True) == []


def test_an_empty_flush_does_not_restart_the_window() -> None:
    live = view()
    live.feed(b"a")
    live.flush(0.0)
    live.flush(200.0)  # nothing to send at 200
    live.feed(b"b")
    assert live.due(201.0)  # 201 ms after the last flush that sent something


# --- chunk cap ---


def test_a_non_final_flush_sends_one_capped_chunk_per_window() -> None:
    live = view(chunk=4096)
    live.feed(b"x" * 10_000)
    sent = []
    for window in range(3):
        now = window * THROTTLE
        flushed = live.flush(now)
        assert len(flushed) == 1
        assert live.flush(now + 1) == []  # one per window, even with more buffered
        sent += flushed
    assert [len(chunk.data) for chunk in sent] == [4096, 4096, 10_000 - 8192]
    assert [chunk.offset for chunk in sent] == [0, 4096, 8192]


def test_a_final_flush_sends_everything_left_in_capped_chunks() -> None:
    live = view(chunk=4096)
    live.feed(b"a")
    live.flush(0.0)
    live.feed(b"y" * 10_000)
    chunks = live.flush(1.0, final=True)  # inside the window: final ignores the throttle
    assert [len(chunk.data) for chunk in chunks] == [4096, 4096, 10_000 - 8192]
    assert b"".join(chunk.data for chunk in chunks) == b"y" * 10_000
    assert_chained(chunks)
    assert live.buffered == 0


def test_after_exit_marks_the_chunks_and_the_view_goes_on_after_a_final_flush() -> None:
    live = view()
    live.feed(b"before")
    [before] = live.flush(0.0, final=True)
    assert not before.after_exit
    live.feed(b"late")
    [late] = live.flush(500.0, after_exit=True)
    assert late.after_exit and late.offset == 6 and late.data == b"late"


# --- the bounded buffer drops the oldest bytes ---


def test_overflow_drops_the_oldest_bytes_and_the_next_chunk_says_so() -> None:
    live = view(chunk=8, buffer=16)
    live.feed(b"0123456789")
    [first] = live.flush(0.0)
    assert (first.offset, first.data) == (0, b"01234567")
    live.feed(b"abcdefghijklmnopqrst")  # 2 + 20 = 22 buffered > 16: the 6 oldest go
    [second] = live.flush(THROTTLE)
    assert second.truncated and second.dropped_bytes == 6
    assert second.offset == 8 + 6
    assert second.data == b"efghijkl"
    [third] = live.flush(2 * THROTTLE)
    assert not third.truncated and third.dropped_bytes == 0
    assert (third.offset, third.data) == (22, b"mnopqrst")
    assert_chained([first, second, third])
    assert sum(len(c.data) + c.dropped_bytes for c in (first, second, third)) == live.fed == 30


def test_a_single_feed_larger_than_the_buffer_keeps_its_newest_bytes() -> None:
    live = view(chunk=8, buffer=16)
    live.feed(b"old")
    live.feed(bytes(range(100)))
    chunks = live.flush(0.0, final=True)
    assert chunks[0].dropped_bytes == 3 + 84 and chunks[0].offset == 87
    assert b"".join(c.data for c in chunks) == bytes(range(84, 100))


def test_a_drop_inside_a_character_drops_its_continuation_bytes_too() -> None:
    live = view(chunk=8, buffer=8)
    live.feed(b"a" + FACE + b"bcdef")  # 10 bytes: dropping 2 would cut the face after its lead
    [chunk] = live.flush(0.0)
    assert chunk.dropped_bytes == 1 + 4 and chunk.offset == 5
    assert chunk.data == b"bcdef" and chunk.text == "bcdef"


def test_a_drop_at_a_character_boundary_drops_nothing_more() -> None:
    live = view(chunk=8, buffer=8)
    live.feed(b"ab" + FACE + FACE)  # 10 bytes: dropping 2 leaves two whole faces
    [chunk] = live.flush(0.0)
    assert chunk.dropped_bytes == 2 and chunk.data == FACE + FACE and chunk.text == "😀😀"


# --- UTF-8 at chunk edges ---


def test_an_unfinished_character_waits_for_its_last_byte() -> None:
    live = view()
    live.feed(b"ab" + EURO[:2])
    [first] = live.flush(0.0)
    assert first.data == b"ab"
    assert live.buffered == 2 and live.next_flush_at() is None  # nothing sendable yet
    live.feed(EURO[2:])
    [second] = live.flush(THROTTLE)
    assert second.data == EURO and second.text == "€" and second.offset == 2


def test_only_an_unfinished_character_is_not_due() -> None:
    live = view()
    live.feed(FACE[:3])
    assert not live.due(0.0) and live.flush(0.0) == []


def test_the_cap_never_cuts_a_character() -> None:
    live = view(chunk=4)
    live.feed(b"a" + EURO + b"b")
    chunks = [*live.flush(0.0), *live.flush(THROTTLE)]
    assert [c.data for c in chunks] == [b"a" + EURO, b"b"]


def test_a_final_flush_sends_an_unfinished_character_as_it_is() -> None:
    live = view()
    live.feed(b"x" + FACE[:2])
    [chunk] = live.flush(0.0, final=True)
    assert chunk.data == b"x" + FACE[:2]
    assert chunk.text == chunk.data.decode("utf-8", "replace") and chunk.text.startswith("x\ufffd")


def test_invalid_bytes_pass_through_and_decode_with_replacement() -> None:
    live = view()
    live.feed(b"\xff\xfeok\xc0")
    [chunk] = live.flush(0.0)
    assert chunk.data == b"\xff\xfeok\xc0"
    assert chunk.text == "\ufffd\ufffdok\ufffd"


@pytest.mark.parametrize(
    ("data", "held"),
    [
        (b"", 0),
        (b"abc", 0),
        (EURO, 0),
        (EURO[:1], 1),
        (EURO[:2], 2),
        (FACE[:3], 3),
        (b"x" + FACE[:3], 3),
        (FACE, 0),
        (b"\xff", 0),
        (b"\xe2\x28", 0),  # not a valid continuation: nothing to wait for
        (b"\xe0\x80", 0),  # an overlong start can never complete
    ],
)
def test_held_back_is_what_a_decoder_waits_for(data: bytes, held: int) -> None:
    assert held_back(data) == held


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=12))
def test_the_last_three_bytes_decide_what_is_held_back(data: bytes) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    assert held_back(data) == len(decoder.getstate()[0]) <= 3


# --- properties ---

_CHARACTERS = st.sampled_from(["a", "\n", "é", "ß", "€", "中", "😀", "𝄞"])


@st.composite
def _splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@settings(max_examples=500, deadline=None)
@given(
    text=st.lists(_CHARACTERS, max_size=300).map("".join),
    chunk=st.integers(4, 40),
    data=st.data(),
)
def test_a_lossless_run_delivers_the_exact_bytes_in_whole_characters(
    text: str, chunk: int, data: st.DataObject
) -> None:
    encoded = text.encode()
    live = view(throttle=10.0, chunk=chunk, buffer=max(chunk, len(encoded) + 1))
    chunks = _run(live, encoded, data)
    assert b"".join(c.data for c in chunks) == encoded
    for c in chunks:
        assert 0 < len(c.data) <= chunk
        assert c.data.decode("utf-8") == c.text  # strict: no chunk starts or ends mid-character
        assert c.dropped_bytes == 0 and not c.truncated
    assert_chained(chunks)


def _run(live: LiveOutput, encoded: bytes, data: st.DataObject) -> list[OutputChunk]:
    """Feed `encoded` in random pieces at random times, flushing when asked; then a final flush."""
    chunks: list[OutputChunk] = []
    now = 0.0
    for piece in data.draw(_splits(encoded)):
        live.feed(piece)
        now += data.draw(st.sampled_from([0.0, 5.0, 10.0]))
        flushed = live.flush(now)
        assert len(flushed) <= 1
        chunks += flushed
    return chunks + live.flush(now, final=True)


@settings(max_examples=500, deadline=None)
@given(
    encoded=st.lists(_CHARACTERS.map(str.encode) | st.binary(min_size=1, max_size=3), max_size=200)
    .map(b"".join),
    chunk=st.integers(4, 16),
    extra=st.integers(0, 24),
    data=st.data(),
)
def test_a_lossy_run_accounts_for_every_byte(
    encoded: bytes, chunk: int, extra: int, data: st.DataObject
) -> None:
    live = view(throttle=10.0, chunk=chunk, buffer=chunk + extra)
    chunks = _run(live, encoded, data)
    assert live.fed == len(encoded) and live.buffered == 0
    assert sum(len(c.data) + c.dropped_bytes for c in chunks) == len(encoded)
    assert_chained(chunks)
    for c in chunks:
        assert encoded[c.offset : c.offset + len(c.data)] == c.data  # the true stream offset
        assert 0 < len(c.data) <= chunk
        assert c.truncated == (c.dropped_bytes > 0)
        assert c.text == c.data.decode("utf-8", "replace")


@settings(max_examples=500, deadline=None)
@given(
    text=st.lists(_CHARACTERS, max_size=200).map("".join),
    chunk=st.integers(4, 16),
    extra=st.integers(0, 24),
    data=st.data(),
)
def test_a_lossy_run_of_text_still_sends_whole_characters(
    text: str, chunk: int, extra: int, data: st.DataObject
) -> None:
    live = view(throttle=10.0, chunk=chunk, buffer=chunk + extra)
    chunks = _run(live, text.encode(), data)
    for c in chunks:
        # Strict: no chunk starts with the orphaned tail of a dropped character or ends early.
        assert c.data.decode("utf-8") == c.text


def test_the_event_body_is_an_exec_output_body() -> None:
    live = view()
    live.feed("héllo".encode())
    [chunk] = live.flush(0.0)
    body = ExecOutputBody.model_validate(chunk.event_body(CALL_ID, "stdout"))
    assert body.bytes == 6 and body.text == "héllo" and body.offset == 0


@pytest.mark.parametrize(
    ("throttle", "chunk", "buffer"), [(-1, 4096, 65536), (150, 3, 65536), (150, 4096, 4095)]
)
def test_impossible_limits_are_refused(throttle: float, chunk: int, buffer: int) -> None:
    with pytest.raises(ValueError):
        LiveOutput(throttle_ms=throttle, max_chunk_bytes=chunk, buffer_bytes=buffer)


# --- head and tail for the result ---


def summary_of(*pieces: bytes, truncated: bool = False) -> dict[str, object]:
    head_tail = StreamHeadTail()
    for piece in pieces:
        head_tail.feed(piece)
    return head_tail.summary(truncated=truncated)


def test_a_short_stream_is_all_head_and_no_tail() -> None:
    assert summary_of(b"hello\n", b"world\n") == {
        "bytes": 12,
        "head": "hello\nworld\n",
        "tail": "",
        "truncated": False,
    }


def test_an_empty_stream() -> None:
    assert summary_of() == {"bytes": 0, "head": "", "tail": "", "truncated": False}


def test_exactly_eight_kib_is_all_head() -> None:
    result = summary_of(b"h" * HEAD_TAIL_BYTES)
    assert result["head"] == "h" * HEAD_TAIL_BYTES and result["tail"] == ""


def test_head_and_tail_do_not_overlap_and_cover_up_to_sixteen_kib() -> None:
    data = bytes(ord("a") + i % 26 for i in range(12_000))
    result = summary_of(data)
    assert result["head"] == data[:HEAD_TAIL_BYTES].decode()
    assert result["tail"] == data[HEAD_TAIL_BYTES:].decode()
    assert result["head"] + result["tail"] == data.decode()


def test_a_long_stream_keeps_its_first_and_last_eight_kib() -> None:
    data = bytes(ord("a") + i % 26 for i in range(100_000))
    result = summary_of(*(data[i : i + 999] for i in range(0, len(data), 999)), truncated=True)
    assert result["bytes"] == 100_000
    assert result["head"] == data[:HEAD_TAIL_BYTES].decode()
    assert result["tail"] == data[-HEAD_TAIL_BYTES:].decode()
    assert result["truncated"] is True


def test_head_and_tail_are_cut_at_character_boundaries() -> None:
    # 8191 ASCII bytes, then a 3-byte character straddling the 8 KiB line, then a long middle.
    data = b"a" * (HEAD_TAIL_BYTES - 1) + EURO + b"b" * 20_000 + EURO + b"c" * (HEAD_TAIL_BYTES - 2)
    result = summary_of(data)
    assert result["head"] == "a" * (HEAD_TAIL_BYTES - 1)  # the euro does not fit whole
    assert result["tail"] == "c" * (HEAD_TAIL_BYTES - 2)  # the euro's lead byte is outside
    assert "\ufffd" not in result["head"] + result["tail"]


def test_the_summary_is_a_stream_summary() -> None:
    StreamSummary.model_validate(summary_of(b"x" * 20_000 + b"\xff", truncated=True))


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(_CHARACTERS, max_size=9000).map("".join),
    data=st.data(),
)
def test_up_to_sixteen_kib_of_text_head_and_tail_are_the_whole_of_it(
    text: str, data: st.DataObject
) -> None:
    encoded = text.encode()[: 2 * HEAD_TAIL_BYTES]
    encoded = encoded[: len(encoded) - held_back(encoded)]
    result = summary_of(*data.draw(_splits(encoded)))
    assert result["bytes"] == len(encoded)
    assert result["head"] + result["tail"] == encoded.decode()
    assert len(result["head"].encode()) <= HEAD_TAIL_BYTES
    assert len(result["tail"].encode()) <= HEAD_TAIL_BYTES


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=40_000), splits=st.data())
def test_feeding_in_pieces_summarises_like_one_feed(data: bytes, splits: st.DataObject) -> None:
    assert summary_of(*splits.draw(_splits(data))) == summary_of(data)
