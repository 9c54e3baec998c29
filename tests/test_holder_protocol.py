"""The holder's files and control protocol as data (supervisor/runtime/holder_protocol.py):
the spec's validation, the framing, requests as the holder parses them, and replies and
events as the daemon decodes them."""

from __future__ import annotations

import base64

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox_supervisor.daemon.runtime import holder_protocol as hp
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    EndedEvent,
    ExitedEvent,
    ExitRecord,
    HolderProtocolError,
    HolderSpec,
    LineSplitter,
    LineTooLong,
    OutputEvent,
    Reply,
    RequestError,
    SpecError,
    TerminalSize,
    decode_message,
    parse_request,
    parse_spec,
)

RECORD = ExitRecord(exit_code=None, signal="SIGKILL", timed_out=True, oom_killed=None, duration_ms=1500, ended_at="2026-01-01T00:00:00.000Z")


def test_a_spec_round_trips_through_its_json():
    spec = HolderSpec(
        argv=("sh", "-c", "true"), cwd="/w", env={"A": "b"}, uid=1000, gid=1000, groups=(1000, 27),
        pty=TerminalSize(24, 80), timeout_s=5.0, kill_grace_s=1.5, spool_max_bytes=1024,
        oom_score_adj=100, cgroup="/sys/fs/cgroup/x", stdin="null",
    )
    assert parse_spec(json.loads(json.dumps(spec.to_json()))) == spec
    minimal = parse_spec({"argv": ["true"], "cwd": "/"})
    assert (minimal.uid, minimal.groups, minimal.pty, minimal.timeout_s, minimal.stdin) == (None, None, None, None, "pipe")


@pytest.mark.parametrize(
    "change, word",
    [
        ({"argv": []}, "argv"),
        ({"argv": ["a\x00b"]}, "argv"),
        ({"cwd": 3}, "cwd"),
        ({"uid": -1}, "uid"),
        ({"uid": True}, "uid"),
        ({"groups": "0"}, "groups"),
        ({"pty": {"rows": 0, "cols": 80}}, "pty.rows"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"kill_grace_s": -1}, "kill_grace_s"),
        ({"oom_score_adj": 1001}, "oom_score_adj"),
        ({"stdin": "tty"}, "stdin"),
        ({"surprise": 1}, "unknown"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(change, word):
    with pytest.raises(SpecError, match=word):
        parse_spec({"argv": ["true"], "cwd": "/", **change})


def test_lines_are_split_across_reads_and_bounded():
    lines = LineSplitter(max_line=10)
    assert lines.feed(b'{"a"') == []
    assert lines.feed(b":1}\n{}\n{") == [b'{"a":1}', b"{}"]
    with pytest.raises(LineTooLong):
        lines.feed(b"x" * 20)
    with pytest.raises(LineTooLong):
        LineSplitter(max_line=4).feed(b"123456\n")


def test_requests_encode_and_parse_back():
    assert parse_request(hp.encode_watch()).op == "watch"
    stdin = parse_request(hp.encode_stdin(7, b"\x00\xff"))
    assert (stdin.op, stdin.offset, stdin.data) == ("stdin", 7, b"\x00\xff")
    assert parse_request(hp.encode_close_stdin(9)).offset == 9
    resize = parse_request(hp.encode_resize(40, 100))
    assert (resize.rows, resize.cols) == (40, 100)
    assert parse_request(hp.encode_signal("SIGINT")).signum == 2
    assert parse_request(hp.encode_terminate()).op == "terminate"
    assert parse_request(hp.encode_modules()).op == "modules"


@pytest.mark.parametrize(
    "line, code",
    [
        (b"{", "bad_request"),
        (b"1", "bad_request"),
        (b'{"op":"fly"}', "unknown_op"),
        (b'{"op":"stdin","offset":0}', "bad_request"),
        (b'{"op":"stdin","offset":"0","data":""}', "bad_request"),
        (b'{"op":"stdin","offset":0,"data":"a"}', "bad_request"),
        (b'{"op":"resize","rows":0,"cols":1}', "bad_request"),
        (b'{"op":"resize","rows":70000,"cols":1}', "bad_request"),
        (b'{"op":"signal","signal":"KILL"}', "bad_request"),
        (b'{"op":"signal","signal":"SIG_DFL"}', "bad_request"),
        (b'{"op":"close_stdin","offset":true}', "bad_request"),
    ],
)
def test_a_bad_request_gets_a_stable_code(line, code):
    with pytest.raises(RequestError) as refused:
        parse_request(line)
    assert refused.value.code == code


@given(st.binary(max_size=200))
def test_parse_request_raises_only_its_typed_error(line):
    try:
        parse_request(line)
    except RequestError:
        pass


def test_the_directly_formatted_lines_are_the_generic_encoders_bytes():
    """encode_stdin, reply_stdin and event_output skip json.dumps (each keystroke makes one
    of each): their bytes are exactly what `_line` makes of the same document."""
    for offset, data in [(0, b""), (7, b"x\n"), (2**53 - 1, bytes(range(256)))]:
        document = {"op": "stdin", "offset": offset, "data": base64.b64encode(data).decode("ascii")}
        assert hp.encode_stdin(offset, data) == hp._line(document)
    for next_offset, closed in [(0, False), (14, True), (2**53 - 1, False)]:
        assert hp.reply_stdin(next_offset, closed) == hp.reply_ok(next=next_offset, closed=closed)
    for stream in ("stdout", "stderr"):
        for total, kept in [(0, 0), (48, 48), (2**40, 2**20)]:
            document = {"ev": "output", "stream": stream, "total": total, "kept": kept}
            assert hp.event_output(stream, total, kept) == hp._line(document)


def test_replies_and_events_decode_for_the_daemon():
    assert decode_message(hp.reply_ok(next=5)) == Reply(ok=True, fields={"next": 5})
    gap = decode_message(hp.reply_error("stdin_gap", "no", expected=3))
    assert gap == Reply(ok=False, code="stdin_gap", message="no", fields={"expected": 3})
    assert decode_message(hp.event_output("stderr", 10, 4)) == OutputEvent("stderr", 10, 4)
    assert decode_message(hp.event_exited(RECORD)) == ExitedEvent(RECORD)
    assert decode_message(hp.event_ended()) == EndedEvent()


@pytest.mark.parametrize(
    "line",
    [b"nope", b"[]", b'{"ok":1}', b'{"ok":false}', b'{"ev":"output","stream":"stdin","total":1,"kept":1}', b'{"ev":"exited"}', b'{"ev":"party"}', b"{}"],
)
def test_a_line_that_is_neither_reply_nor_event_is_a_protocol_error(line):
    with pytest.raises(HolderProtocolError):
        decode_message(line)


def test_the_control_socket_path_fits_sun_path_whatever_the_directory():
    assert len(hp.control_socket_path(1_000_000).encode()) < 108


@given(st.binary(max_size=200) | st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["ok", "ev", "code", "message", "stream", "total", "kept", "exit_code", "signal", "timed_out", "oom_killed", "duration_ms", "ended_at"]), inner, max_size=8)).map(lambda doc: json.dumps(doc).encode()))
def test_decode_message_raises_only_its_typed_error(line):
    try:
        decode_message(line)
    except HolderProtocolError:
        pass


@pytest.mark.parametrize("parse, error", [(parse_request, RequestError), (decode_message, HolderProtocolError)])
def test_json_nested_past_the_stack_is_a_typed_error(parse, error):
    with pytest.raises(error):
        parse(b"[" * 200_000)


def test_an_exit_record_with_an_infinite_duration_is_a_protocol_error():
    with pytest.raises(HolderProtocolError):
        decode_message(b'{"ev":"exited","exit_code":0,"signal":null,"timed_out":false,"oom_killed":null,"duration_ms":1e999,"ended_at":"x"}')
