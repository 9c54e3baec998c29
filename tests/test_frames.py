"""Frame models, decode and encode (docs/protocol.md §6)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sandbox_supervisor.protocol import PROTOCOL_VERSION
from sandbox_supervisor.protocol.errors import INVALID_FRAME, UNKNOWN_KIND
from sandbox_supervisor.protocol.frames import CLIENT_KINDS, BootstrapRejectedBody, BootstrapRejectedFrame, ErrorBody, ErrorFrame, EventsAckFrame, ExecCloseStdinFrame, ExecCompletedBody, ExecCompletedEvent, ExecContext, ExecListFrame, ExecProcessesBody, ExecProcessesFrame, ExecResizeFrame, ExecStdinAckBody, ExecStdinAckFrame, ExecWriteStdinFrame, ProcessExit, ProcessInfo, ExecOutputBody, ExecOutputEvent, ExecOutputPageBody, ExecOutputPageFrame, ExecReadOutputFrame, ExecSignalFrame, ExecStartedBody, ExecStartedEvent, FrameError, RuntimeStateBody, RuntimeStateFrame, SessionBootstrapFrame, ToolCallFrame, ToolError, ToolPendingBody, ToolPendingFrame, ToolReplayedBody, ToolReplayedFrame, ToolResultBody, ToolResultEvent, decode_client_frame, decode_server_frame, encode_frame
from sandbox_supervisor.protocol.tools import StreamSummary
from sandbox_supervisor.protocol.headers import MAX_SAFE_INTEGER
from sandbox_supervisor.testing.fuzzing import fuzz_settings

CALL_ID = "6f1c2a0e-8d4b-4c1e-9a57-0b7e3f2d1c44"

CLIENT_SAMPLES: dict[str, tuple[type, dict[str, Any]]] = {
    "session.bootstrap": (
        SessionBootstrapFrame,
        {
            "kind": "session.bootstrap",
            "connectionGeneration": 2,
            "body": {
                "sessionId": "s-1",
                "agent": {"cwd": "/work", "profile": "default", "env": {"CI": "1"}},
                "repositories": [{"name": "app", "root": "/work/app"}],
            },
        },
    ),
    "tool.call": (
        ToolCallFrame,
        {"kind": "tool.call", "connectionGeneration": 2, "body": {"anything": [1, {"x": None}]}},
    ),
    "events.ack": (
        EventsAckFrame,
        {"kind": "events.ack", "connectionGeneration": 2, "body": {"seq": 7}},
    ),
    "exec.signal": (
        ExecSignalFrame,
        {
            "kind": "exec.signal",
            "connectionGeneration": 2,
            "body": {"call_id": CALL_ID, "signal": "SIGTERM"},
        },
    ),
    "exec.read_output": (
        ExecReadOutputFrame,
        {
            "kind": "exec.read_output",
            "connectionGeneration": 2,
            "body": {"call_id": CALL_ID, "stream": "stderr", "offset": 0, "length": 65536},
        },
    ),
    "exec.write_stdin": (
        ExecWriteStdinFrame,
        {
            "kind": "exec.write_stdin",
            "connectionGeneration": 2,
            "body": {"call_id": CALL_ID, "offset": 6, "data": "aGVsbG8K"},
        },
    ),
    "exec.close_stdin": (
        ExecCloseStdinFrame,
        {"kind": "exec.close_stdin", "connectionGeneration": 2, "body": {"call_id": CALL_ID, "offset": 12}},
    ),
    "exec.resize": (
        ExecResizeFrame,
        {"kind": "exec.resize", "connectionGeneration": 2, "body": {"call_id": CALL_ID, "rows": 40, "cols": 120}},
    ),
    "exec.list": (ExecListFrame, {"kind": "exec.list", "connectionGeneration": 2, "body": {}}),
}


def compact(document: object) -> str:
    return json.dumps(document, separators=(",", ":"))


def sample(kind: str) -> dict[str, Any]:
    return json.loads(json.dumps(CLIENT_SAMPLES[kind][1]))


def frame_error(raw: str | bytes) -> FrameError:
    with pytest.raises(FrameError) as caught:
        decode_client_frame(raw)
    return caught.value


def test_every_client_kind_has_a_sample() -> None:
    assert set(CLIENT_SAMPLES) == CLIENT_KINDS


@pytest.mark.parametrize("kind", sorted(CLIENT_SAMPLES))
def test_each_client_kind_decodes_to_its_model_and_encodes_back(kind: str) -> None:
    model, document = CLIENT_SAMPLES[kind]
    frame = decode_client_frame(compact(document))
    assert type(frame) is model
    assert encode_frame(frame) == compact(document)


@pytest.mark.parametrize("kind", sorted(CLIENT_SAMPLES))
def test_bytes_decode_like_text(kind: str) -> None:
    raw = compact(sample(kind))
    assert decode_client_frame(raw.encode()) == decode_client_frame(raw)


def test_tool_call_body_is_kept_for_the_second_stage() -> None:
    frame = decode_client_frame(compact(sample("tool.call")))
    assert frame.body == {"anything": [1, {"x": None}]}


@pytest.mark.parametrize("kind", sorted(CLIENT_SAMPLES))
def test_unknown_envelope_field_is_invalid_frame(kind: str) -> None:
    document = sample(kind) | {"SECRETFIELD": 1}
    error = frame_error(compact(document))
    assert error.code == INVALID_FRAME
    assert error.kind == kind
    assert "SECRETFIELD" not in error.message


@pytest.mark.parametrize(
    "kind", ["session.bootstrap", "events.ack", "exec.signal", "exec.read_output"]
)
def test_unknown_body_field_is_invalid_frame(kind: str) -> None:
    document = sample(kind)
    document["body"]["extra"] = True
    assert frame_error(compact(document)).code == INVALID_FRAME


@pytest.mark.parametrize("kind", sorted(CLIENT_SAMPLES))
@pytest.mark.parametrize("missing", ["connectionGeneration", "body"])
def test_missing_envelope_field_is_invalid_frame(kind: str, missing: str) -> None:
    document = sample(kind)
    del document[missing]
    assert frame_error(compact(document)).code == INVALID_FRAME


def test_unknown_kind_is_reported_with_its_name_for_logs() -> None:
    error = frame_error(compact({"kind": "exec.teleport", "connectionGeneration": 1, "body": {}}))
    assert error.code == UNKNOWN_KIND
    assert error.kind == "exec.teleport"
    assert "teleport" not in error.message


def test_a_server_kind_sent_by_a_client_is_unknown() -> None:
    assert frame_error(compact({"kind": "tool.result", "body": {}})).code == UNKNOWN_KIND


def test_unknown_kind_with_a_readable_call_id_keeps_it() -> None:
    error = frame_error(compact({"kind": "nope", "body": {"call_id": CALL_ID}}))
    assert (error.code, error.call_id) == (UNKNOWN_KIND, CALL_ID)


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "nul",
        "[]",
        '"session.bootstrap"',
        "1",
        "{}",
        '{"kind": 5, "connectionGeneration": 1, "body": {}}',
        '{"kind": null}',
        b"\xff\xfe",
        "[" * 100_000,
        '{"a":' * 10_000,
    ],
)
def test_non_frames_are_invalid_frame(raw: str | bytes) -> None:
    assert frame_error(raw).code == INVALID_FRAME


@pytest.mark.parametrize("generation", [True, False, 1.0, "1", 0, -1, MAX_SAFE_INTEGER + 1, None])
def test_connection_generation_must_be_a_json_integer_in_range(generation: object) -> None:
    document = sample("events.ack") | {"connectionGeneration": generation}
    assert frame_error(compact(document)).code == INVALID_FRAME


@pytest.mark.parametrize("seq", [True, 1.0, "1", -1, MAX_SAFE_INTEGER + 1])
def test_ack_seq_rejects_bools_floats_strings_and_out_of_range(seq: object) -> None:
    document = sample("events.ack")
    document["body"]["seq"] = seq
    assert frame_error(compact(document)).code == INVALID_FRAME


def test_ack_seq_bounds_are_inclusive() -> None:
    for seq in (0, MAX_SAFE_INTEGER):
        document = sample("events.ack")
        document["body"]["seq"] = seq
        assert decode_client_frame(compact(document)).body.seq == seq


@pytest.mark.parametrize("length", [0, 65537, True])
def test_read_output_length_is_1_to_65536(length: object) -> None:
    document = sample("exec.read_output")
    document["body"]["length"] = length
    error = frame_error(compact(document))
    assert error.code == INVALID_FRAME
    # A readable call_id lets the error frame name the call.
    assert error.call_id == CALL_ID


@pytest.mark.parametrize("signal", ["SIGUSR1", "sigterm", "9", 9])
def test_exec_signal_accepts_only_the_four_signals(signal: object) -> None:
    document = sample("exec.signal")
    document["body"]["signal"] = signal
    error = frame_error(compact(document))
    assert (error.code, error.kind, error.call_id) == (INVALID_FRAME, "exec.signal", CALL_ID)


@pytest.mark.parametrize(
    "call_id", ["not-a-uuid", CALL_ID.replace("-", ""), "{" + CALL_ID + "}", 5]
)
def test_unreadable_call_id_is_not_reported(call_id: object) -> None:
    document = sample("exec.signal")
    document["body"]["call_id"] = call_id
    error = frame_error(compact(document))
    assert error.code == INVALID_FRAME
    assert error.call_id is None


def test_bootstrap_body_rules_are_frame_rules() -> None:
    document = sample("session.bootstrap")
    document["body"]["agent"]["cwd"] = "relative/path"
    error = frame_error(compact(document))
    assert (error.code, error.kind) == (INVALID_FRAME, "session.bootstrap")


# ------------------------------- server frames -------------------------------


def stream_summary() -> StreamSummary:
    return StreamSummary(bytes=3, head="hi\n", tail="hi\n", truncated=False)


def tool_result_event(seq: int = 5) -> ToolResultEvent:
    return ToolResultEvent(
        seq=seq,
        body=ToolResultBody(
            call_id=CALL_ID,
            idempotency_key="key-1",
            tool_name="apply_file_patch",
            ok=False,
            error=ToolError(
                code="base_sha_mismatch", message="File changed.", current_sha="a" * 40
            ),
        ),
    )


SERVER_SAMPLES = [
    RuntimeStateFrame(
        body=RuntimeStateBody(
            status="ready",
            sessionId="s-1",
            generation=2,
            ackFloor=0,
            localEventMax=4,
            oldestRetainedSeq=1,
            supervisorVersion="0.1.0",
            protocolVersion=1,
            scopes=["files:read", "shell:exec"],
        )
    ),
    BootstrapRejectedFrame(body=BootstrapRejectedBody(code="profile_not_allowed", message="No.")),
    ToolPendingFrame(body=ToolPendingBody(call_id=CALL_ID, idempotency_key="key-1")),
    ToolReplayedFrame(
        body=ToolReplayedBody(
            call_id=CALL_ID, idempotency_key="key-1", original=tool_result_event()
        )
    ),
    ExecOutputPageFrame(
        body=ExecOutputPageBody(
            call_id=CALL_ID, stream="stdout", offset=0, data="aGk=", eof=True, truncated=False
        )
    ),
    ExecStdinAckFrame(body=ExecStdinAckBody(call_id=CALL_ID, offset=0, next_offset=6, closed=False)),
    ExecProcessesFrame(
        body=ExecProcessesBody(
            processes=[
                ProcessInfo(
                    call_id=CALL_ID, tool_name="start_process", command="npm run dev", pid=41, pgid=41,
                    pty=True, started_at=1.5, running=False,
                    exit=ProcessExit(exit_code=0, signal=None, timed_out=False),
                )
            ]
        )
    ),
    ErrorFrame(body=ErrorBody(code="forbidden", message="No scope.", call_id=CALL_ID)),
    ErrorFrame(body=ErrorBody(code="invalid_frame", message="Bad.")),
    ExecStartedEvent(
        seq=1,
        body=ExecStartedBody(
            call_id=CALL_ID,
            pid=100,
            pgid=100,
            command="echo hi",
            cwd="/work",
            started_at=1_700_000_000.25,
            context=ExecContext(session_id="s-1", generation=2, idempotency_key="key-1"),
        ),
    ),
    ExecOutputEvent(
        seq=2,
        body=ExecOutputBody(
            call_id=CALL_ID,
            stream="stdout",
            text="hi\n",
            offset=0,
            bytes=3,
            truncated=False,
            dropped_bytes=0,
            after_exit=False,
        ),
    ),
    ExecCompletedEvent(
        seq=3,
        body=ExecCompletedBody(
            call_id=CALL_ID,
            exit_code=0,
            signal=None,
            timed_out=False,
            duration_ms=12,
            stdout=stream_summary(),
            stderr=stream_summary(),
        ),
    ),
    tool_result_event(),
    ToolResultEvent(
        seq=4,
        body=ToolResultBody(
            call_id=CALL_ID,
            idempotency_key=None,
            tool_name="read_file",
            ok=True,
            result={"size": 1},
        ),
    ),
]


@pytest.mark.parametrize("frame", SERVER_SAMPLES, ids=lambda frame: frame.kind)
def test_server_frames_round_trip_through_compact_json(frame: Any) -> None:
    text = encode_frame(frame)
    # Compact: exactly what json.dumps with the tightest separators would write.
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    assert decode_server_frame(text) == frame
    assert encode_frame(decode_server_frame(text)) == text


def test_encoding_keeps_field_order_and_omits_absent_optional_call_id() -> None:
    assert encode_frame(ErrorFrame(body=ErrorBody(code="x", message="m"))) == (
        '{"kind":"error","body":{"code":"x","message":"m"}}'
    )
    assert encode_frame(ErrorFrame(body=ErrorBody(code="x", message="m", call_id=CALL_ID))) == (
        f'{{"kind":"error","body":{{"code":"x","message":"m","call_id":"{CALL_ID}"}}}}'
    )


def test_tool_result_omits_the_absent_outcome_and_keeps_null_key() -> None:
    ok = json.loads(encode_frame(SERVER_SAMPLES[-1]))
    assert ok["body"] == {
        "call_id": CALL_ID,
        "idempotency_key": None,
        "tool_name": "read_file",
        "ok": True,
        "result": {"size": 1},
    }
    failed = json.loads(encode_frame(tool_result_event()))
    assert "result" not in failed["body"]
    # Extra fields of an error are kept, after code and message.
    assert list(failed["body"]["error"]) == ["code", "message", "current_sha"]


@pytest.mark.parametrize(
    ("ok", "outcome"),
    [
        (True, {}),
        (False, {}),
        (True, {"error": ToolError(code="internal", message="m")}),
        (False, {"result": {}}),
        (True, {"result": {}, "error": ToolError(code="internal", message="m")}),
    ],
)
def test_tool_result_needs_exactly_the_outcome_ok_says(ok: bool, outcome: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ToolResultBody(
            call_id=CALL_ID, idempotency_key=None, tool_name="read_file", ok=ok, **outcome
        )


def test_tool_replayed_embeds_the_original_event_unchanged() -> None:
    # The store keeps the journaled text; a replay built from it must embed it as is.
    original = encode_frame(tool_result_event(seq=9))
    replayed = ToolReplayedFrame(
        body=ToolReplayedBody(
            call_id=CALL_ID, idempotency_key="key-1", original=json.loads(original)
        )
    )
    assert f'"original":{original}' in encode_frame(replayed)


@pytest.mark.parametrize("version", [True, 1.0, 2])
def test_protocol_version_is_exactly_the_integer_1(version: object) -> None:
    body = SERVER_SAMPLES[0].body.model_dump() | {"protocolVersion": version}
    with pytest.raises(ValidationError):
        RuntimeStateBody.model_validate(body)


def test_protocol_version_field_accepts_the_package_version() -> None:
    body = SERVER_SAMPLES[0].body.model_dump() | {"protocolVersion": PROTOCOL_VERSION}
    assert RuntimeStateBody.model_validate(body).protocolVersion == PROTOCOL_VERSION


def test_runtime_state_refuses_unknown_scopes() -> None:
    body = SERVER_SAMPLES[0].body.model_dump() | {"scopes": ["root"]}
    with pytest.raises(ValidationError):
        RuntimeStateBody.model_validate(body)


def test_models_are_frozen() -> None:
    with pytest.raises(ValidationError):
        SERVER_SAMPLES[0].kind = "error"  # type: ignore[misc]


def test_exec_completed_carries_interrupted_false_by_default() -> None:
    completed = json.loads(encode_frame(next(f for f in SERVER_SAMPLES if f.kind == "exec.completed")))
    assert completed["body"]["interrupted"] is False
    assert completed["body"]["call_id"] == CALL_ID


# ------------------------------- decode is total -------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_frame_like = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from(sorted(CLIENT_KINDS)) | st.text(max_size=12) | _json_values,
        "connectionGeneration": st.integers(min_value=-2, max_value=2**54) | _json_values,
        "body": st.dictionaries(
            st.sampled_from(["call_id", "seq", "signal", "stream", "offset", "length", "sessionId"])
            | st.text(max_size=6),
            st.just(CALL_ID) | st.integers(min_value=-1, max_value=70000) | _json_values,
            max_size=5,
        )
        | _json_values,
        "extra": _json_values,
    },
)


def _decode_or_frame_error(raw: str | bytes) -> None:
    try:
        decode_client_frame(raw)
    except FrameError as error:
        assert error.code in {INVALID_FRAME, UNKNOWN_KIND}
        assert error.message
        assert error.call_id is None or isinstance(error.call_id, str)


@pytest.mark.fuzz
@fuzz_settings(500)
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_text_and_bytes_raise_only_frame_error(raw: str | bytes) -> None:
    _decode_or_frame_error(raw)


@pytest.mark.fuzz
@fuzz_settings(800)
@given(_frame_like | _json_values)
def test_arbitrary_json_raises_only_frame_error(document: object) -> None:
    _decode_or_frame_error(json.dumps(document))


@pytest.mark.fuzz
@fuzz_settings(300)
@given(st.sampled_from(sorted(CLIENT_KINDS)), st.data())
def test_valid_frames_with_one_value_replaced_never_escape(kind: str, data: st.DataObject) -> None:
    document = sample(kind)
    target = data.draw(st.sampled_from(["envelope", "body"]))
    holder = document if target == "envelope" else document["body"]
    existing = st.sampled_from(sorted(holder)) if holder else st.nothing()  # exec.list's body is {}
    key = data.draw(existing | st.text(max_size=5))
    holder[key] = data.draw(_json_values)
    _decode_or_frame_error(json.dumps(document))


def test_call_ids_are_compared_as_given() -> None:
    upper = str(uuid.UUID(CALL_ID)).upper()
    document = sample("exec.signal")
    document["body"]["call_id"] = upper
    assert decode_client_frame(compact(document)).body.call_id == upper
