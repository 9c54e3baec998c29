"""Request ids on exec.* frames (docs/protocol.md §6.3, §6.5): a client-chosen `request_id` is
echoed in the body of whatever answers the request (a page, JSON or binary, an exec.stdin_ack,
exec.processes, an `error`), over a real socket; a request without one gets an answer without
the field, as before."""

from __future__ import annotations

import base64
import json
import uuid

import pytest

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import (
    MAX_REQUEST_ID_CHARS,
    ExecReadOutputBody,
    decode_server_frame,
)

DEADLINE_S = 20.0
ABSENT_CALL = "00000000-0000-4000-8000-000000000000"


async def _ended_command(session) -> str:
    call_id = await session.call(
        "execute_shell_command", {"command": "printf out; printf err >&2"}, idempotency_key=f"k-{uuid.uuid4()}"
    )
    result = await session.result(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result
    return call_id


async def _answers(session, count: int) -> list[dict]:
    """The next `count` frames that are not journaled events, in the order they came."""
    frames = []
    while len(frames) < count:
        frame = await session.receive(timeout=DEADLINE_S)
        if "seq" not in frame:
            frames.append(frame)
    return frames


async def test_pages_and_an_unknown_call_in_flight_are_matched_by_request_id(daemon, transport):
    client = daemon.client(daemon.tcp if transport == "tcp" else daemon.unix)
    async with client.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        call_id = await _ended_command(session)
        requests = {
            "read.stdout:1": {"call_id": call_id, "stream": "stdout", "offset": 0, "length": 100},
            "read.stderr:2": {"call_id": call_id, "stream": "stderr", "offset": 0, "length": 100},
            "read.absent:3": {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 100},
        }
        for request_id, body in requests.items():
            await session.send("exec.read_output", {**body, "request_id": request_id})
        answers = {frame["body"]["request_id"]: frame for frame in await _answers(session, len(requests))}
    assert set(answers) == set(requests)
    for frame in answers.values():
        decode_server_frame(json.dumps(frame))  # every answer matches the published schema
    stdout, stderr, absent = (answers[request_id] for request_id in requests)
    assert (stdout["kind"], base64.b64decode(stdout["body"]["data"])) == ("exec.output_page", b"out")
    assert (stderr["kind"], base64.b64decode(stderr["body"]["data"])) == ("exec.output_page", b"err")
    assert absent["kind"] == "error"
    assert absent["body"] == {
        "code": errors.UNKNOWN_CALL, "message": "No such command call.", "call_id": ABSENT_CALL, "request_id": "read.absent:3",
    }


async def test_a_request_without_an_id_gets_an_answer_without_the_field(session):
    call_id = await _ended_command(session)
    await session.send("exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": 0, "length": 10})
    await session.send("exec.read_output", {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 10})
    await session.send("exec.list", {})
    page, error, listed = await _answers(session, 3)
    assert page["kind"] == "exec.output_page" and "request_id" not in page["body"]
    assert error["kind"] == "error" and "request_id" not in error["body"]
    assert listed == {"kind": "exec.processes", "body": {"processes": []}}


async def test_a_binary_page_header_echoes_the_request_id(session):
    call_id = await _ended_command(session)
    await session.send(
        "exec.read_output",
        {"call_id": call_id, "stream": "stdout", "offset": 0, "length": 10, "format": "binary", "request_id": "b-1"},
    )
    (page,) = await _answers(session, 1)
    assert page["body"]["request_id"] == "b-1" and page["data"] == b"out"


async def test_stdin_ack_processes_and_held_errors_echo_the_request_id(session):
    # Two reads: the process is still running when the resize comes (the first line alone
    # could end it first, and the resize would then be refused not_running).
    call_id = await session.call(
        "start_process", {"command": "read -r line; read -r more; echo got $line"}, idempotency_key="held"
    )
    assert (await session.result(call_id, timeout=DEADLINE_S))["ok"] is True
    data = base64.b64encode(b"x\n").decode()
    await session.send("exec.write_stdin", {"call_id": call_id, "offset": 0, "data": data, "request_id": "w-1"})
    await session.send("exec.list", {"request_id": "l-1"})
    await session.send("exec.resize", {"call_id": call_id, "rows": 10, "cols": 10, "request_id": "z-1"})
    ack, listed, resized = await _answers(session, 3)
    assert ack["kind"] == "exec.stdin_ack" and ack["body"]["request_id"] == "w-1"
    assert listed["kind"] == "exec.processes" and listed["body"]["request_id"] == "l-1"
    # No terminal: the refusal names the request. (A resize or signal that succeeds has no
    # answer at all, §7.7.3: the next answer in order says it did not fail.)
    assert resized["body"] == {
        "code": errors.NOT_A_TERMINAL, "message": "The process has no terminal.", "call_id": call_id, "request_id": "z-1",
    }
    await session.send("exec.close_stdin", {"call_id": call_id, "offset": 2, "request_id": "c-0"})
    (eof,) = await _answers(session, 1)
    assert eof["kind"] == "exec.stdin_ack" and eof["body"]["request_id"] == "c-0" and eof["body"]["closed"]
    await session.exec_completed(call_id, timeout=DEADLINE_S)
    await session.send("exec.close_stdin", {"call_id": call_id, "offset": 2, "request_id": "c-1"})
    (closed,) = await _answers(session, 1)
    assert closed["body"]["code"] == errors.NOT_RUNNING and closed["body"]["request_id"] == "c-1"


async def test_frame_level_refusals_echo_a_valid_request_id(daemon):
    client = daemon.client(scope="files:read session:control")  # no shell:exec
    async with client.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        # Schema failure (length 0), a stale generation, a missing scope, an unknown kind: each
        # error carries the id, so a client with many requests in flight knows which failed.
        await session.send("exec.read_output", {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 0, "request_id": "bad-1"})
        await session.send("exec.list", {"request_id": "old-1"}, generation=session.generation + 1)
        await session.send("exec.list", {"request_id": "scope-1"})
        await session.send("exec.future", {"request_id": "new-1"})
        # An id the schema refuses is never echoed (here: a space): the frame is invalid.
        await session.send("exec.list", {"request_id": "has space"})
        answers = await _answers(session, 5)
    assert [(f["body"]["code"], f["body"].get("request_id")) for f in answers] == [
        (errors.INVALID_FRAME, "bad-1"),
        (errors.GENERATION_MISMATCH, "old-1"),
        (errors.FORBIDDEN, "scope-1"),
        (errors.UNKNOWN_KIND, "new-1"),
        (errors.INVALID_FRAME, None),
    ]


@pytest.mark.parametrize("request_id", ["", "x" * (MAX_REQUEST_ID_CHARS + 1), "a/b", "é", "a\nb"])
def test_request_ids_outside_the_pattern_and_length_are_refused(request_id):
    body = {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 1, "request_id": request_id}
    with pytest.raises(ValueError):
        ExecReadOutputBody.model_validate(body)


def test_the_longest_request_id_is_accepted():
    body = {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 1, "request_id": "A-z.0:_" * 18 + "xy"}
    assert len(body["request_id"]) == MAX_REQUEST_ID_CHARS
    assert ExecReadOutputBody.model_validate(body).request_id == body["request_id"]


async def test_the_reference_client_takes_its_own_answer_and_keeps_the_others(session):
    """testing/client.py matches by request id: an answer to another request that arrives
    first is kept for whoever asked, not taken for the helper's and not dropped."""
    call_id = await _ended_command(session)
    await session.send("exec.read_output", {"call_id": ABSENT_CALL, "stream": "stdout", "offset": 0, "length": 1, "request_id": "theirs"})
    body, data = await session.read_output(call_id, "stderr", 0, 100)
    assert (body["stream"], data) == ("stderr", b"err")
    assert "request_id" not in body  # the helper's bookkeeping, not the caller's
    kept = await session.answer("theirs")
    assert kept["body"]["code"] == errors.UNKNOWN_CALL
