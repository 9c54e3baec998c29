"""Frames written directly on the hot path are byte for byte what the one typed encoder gives
for the same values, and refuse exactly what the model refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandbox_supervisor.protocol.frames import (
    EXEC_OUTPUT,
    MAX_REQUEST_ID_CHARS,
    ExecOutputEvent,
    ExecStdinAckBody,
    ExecStdinAckFrame,
    _exec_output_direct,
    encode_event,
    encode_frame,
    encode_stdin_ack,
)
from sandbox_supervisor.protocol.headers import MAX_SAFE_INTEGER

CALL_ID = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21"


def generic(call_id: object, offset: object, next_offset: object, closed: object, request_id: object) -> str:
    body = {"call_id": call_id, "offset": offset, "next_offset": next_offset, "closed": closed, "request_id": request_id}
    return encode_frame(ExecStdinAckFrame(body=ExecStdinAckBody.model_validate(body)))


@pytest.mark.parametrize(
    ("call_id", "offset", "next_offset", "closed", "request_id"),
    [
        (CALL_ID, 0, 0, False, None),
        (CALL_ID, 3, 5, True, "r1"),
        (CALL_ID.upper(), MAX_SAFE_INTEGER, MAX_SAFE_INTEGER, False, "a.b_c:d-e"),
        (CALL_ID, 7, 2, True, "x" * MAX_REQUEST_ID_CHARS),  # a gap: next below offset
        (CALL_ID, 1, 1, False, "0"),
    ],
)
def test_stdin_ack_is_the_generic_encoders_bytes(call_id, offset, next_offset, closed, request_id) -> None:
    assert encode_stdin_ack(call_id, offset, next_offset, closed, request_id) == generic(
        call_id, offset, next_offset, closed, request_id
    )


@pytest.mark.parametrize(
    ("call_id", "offset", "next_offset", "closed", "request_id"),
    [
        ("not-a-uuid", 0, 0, False, None),
        (CALL_ID + "\n", 0, 0, False, None),  # re's $ would match before a final newline
        (CALL_ID, -1, 0, False, None),
        (CALL_ID, MAX_SAFE_INTEGER + 1, 0, False, None),  # a big int past the protocol's range
        (CALL_ID, 0, 10**30, False, None),
        (CALL_ID, True, 0, False, None),  # a bool is not a count
        (CALL_ID, 0, 0, 1, None),  # nor an int a bool
        (CALL_ID, 0, 0, False, ""),
        (CALL_ID, 0, 0, False, "r1\n"),
        (CALL_ID, 0, 0, False, 'r"1'),  # a character JSON would escape
        (CALL_ID, 0, 0, False, "r\u00e9"),  # unicode
        (CALL_ID, 0, 0, False, "\u0001"),  # a control character
        (CALL_ID, 0, 0, False, "x" * (MAX_REQUEST_ID_CHARS + 1)),
    ],
)
def test_stdin_ack_refuses_what_the_model_refuses(call_id, offset, next_offset, closed, request_id) -> None:
    with pytest.raises(ValidationError):
        generic(call_id, offset, next_offset, closed, request_id)
    with pytest.raises(ValidationError):
        encode_stdin_ack(call_id, offset, next_offset, closed, request_id)


# exec.output: every character class JSON writes apart (control characters with and without a
# short escape, the quote, the backslash, DEL, the C1 controls, the line and paragraph
# separators, the BOM, noncharacters, the replacement character, astral characters) and every
# range edge of its counts.
EVERY_ESCAPE = "".join(chr(code) for code in range(0x80)) + "\x7f\x80\x9f\xa0\u2028\u2029\ufeff\ufffd\uffff\U0001f600\U0010ffff"


def output_body(**changes: object) -> dict[str, object]:
    body: dict[str, object] = {
        "call_id": CALL_ID,
        "stream": "stdout",
        "text": "x\r\n",
        "offset": 0,
        "bytes": 3,
        "truncated": False,
        "dropped_bytes": 0,
        "after_exit": False,
    }
    body.update(changes)
    return body


def generic_output(seq: object, body: object) -> str:
    return encode_frame(ExecOutputEvent.model_validate({"kind": EXEC_OUTPUT, "seq": seq, "body": body}))


@pytest.mark.parametrize(
    ("seq", "body"),
    [
        (1, output_body()),
        (MAX_SAFE_INTEGER, output_body(stream="stderr", offset=MAX_SAFE_INTEGER, bytes=MAX_SAFE_INTEGER)),
        (7, output_body(text="", bytes=0, truncated=True, dropped_bytes=MAX_SAFE_INTEGER, after_exit=True)),
        (2, output_body(text=EVERY_ESCAPE)),
        (3, output_body(text='"\\/\b\f\n\r\t\x00\x1f')),
        (4, output_body(text="caf\u00e9 \u65e5\u672c \U0001f600")),
        (5, output_body(call_id=CALL_ID.upper())),
        (6, dict(reversed(list(output_body().items())))),  # members in another order
    ],
)
def test_exec_output_is_the_generic_encoders_bytes(seq, body) -> None:
    direct = _exec_output_direct(seq, body)
    assert direct is not None  # written directly, not through the model
    assert direct == generic_output(seq, body)
    assert encode_event(EXEC_OUTPUT, seq, body) == direct


@pytest.mark.parametrize(
    ("seq", "body"),
    [
        (0, output_body()),  # a seq starts at 1
        (MAX_SAFE_INTEGER + 1, output_body()),
        (True, output_body()),  # a bool is not a seq
        (1, output_body(call_id="not-a-uuid")),
        (1, output_body(call_id=CALL_ID + "\n")),
        (1, output_body(stream="stdin")),
        (1, output_body(text=b"x")),  # bytes are not text
        (1, output_body(text=None)),
        (1, output_body(text="a\ud800b")),  # a lone surrogate: JSON of it is refused on writing
        (1, output_body(offset=-1)),
        (1, output_body(bytes=MAX_SAFE_INTEGER + 1)),
        (1, output_body(dropped_bytes=1.0)),
        (1, output_body(offset=True)),
        (1, output_body(truncated=0)),
        (1, output_body(after_exit="false")),
        (1, output_body(extra=1)),
        (1, {key: value for key, value in output_body().items() if key != "after_exit"}),
    ],
)
def test_exec_output_refuses_what_the_model_refuses(seq, body) -> None:
    assert _exec_output_direct(seq, body) is None  # left to the model, which refuses it
    with pytest.raises(ValueError):
        generic_output(seq, body)
    with pytest.raises(ValueError):
        encode_event(EXEC_OUTPUT, seq, body)


def test_stdin_ack_leaves_string_subclasses_to_the_model() -> None:
    """A str subclass may format itself differently from its value (`__format__`): the direct
    path takes plain strings only, and the model's bytes are the answer for anything else."""

    class Odd(str):
        def __format__(self, spec: str) -> str:
            return "zz"

    expected = generic(CALL_ID, 1, 2, False, "r1")
    assert encode_stdin_ack(Odd(CALL_ID), 1, 2, False, "r1") == expected
    assert encode_stdin_ack(CALL_ID, 1, 2, False, Odd("r1")) == expected


def test_exec_output_leaves_a_text_subclass_to_the_model() -> None:
    class Text(str):
        pass

    body = output_body(text=Text("x\n"))
    assert _exec_output_direct(1, body) is None
    assert encode_event(EXEC_OUTPUT, 1, body) == generic_output(1, output_body(text="x\n"))
