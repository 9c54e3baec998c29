"""Frames written directly on the hot path are byte for byte what the one typed encoder gives
for the same values, and refuse exactly what the model refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandbox_supervisor.protocol.frames import (
    MAX_REQUEST_ID_CHARS,
    ExecStdinAckBody,
    ExecStdinAckFrame,
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
