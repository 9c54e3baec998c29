"""The exported JSON Schemas are plain draft 2020-12 that Python's jsonschema takes without
options, and they describe the frames the daemon really sends and takes: every frame of a
session (replies, events, binary page headers) and every client frame is valid, and frames
the models refuse are refused by the schemas too. (Ajv's strict mode is checked by the
TypeScript client's tests, tests/test_typescript_client.py.)"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from sandbox_supervisor.protocol import frames, tools
from sandbox_supervisor.protocol.schema_export import (
    DEFAULT_OUT_DIR,
    OPENAPI_ONLY_KEYWORDS,
    SCHEMA_DIALECT,
    UNDECLARED_FORMATS,
    portable,
)

CALL_ID = "a96fb13d-92b2-4583-8807-c8d6fbbab508"
SCHEMA_NAMES = sorted(path.stem for path in DEFAULT_OUT_DIR.glob("*.json"))


def _schema(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((DEFAULT_OUT_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return document


def _validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(_schema(name))


def _keywords(schema: Any, found: set[str] | None = None) -> set[str]:
    """Every key used anywhere (keywords and property names alike: a superset)."""
    found = set() if found is None else found
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            _keywords(value, found)
    elif isinstance(schema, list):
        for value in schema:
            _keywords(value, found)
    return found


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = _schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == SCHEMA_DIALECT
    assert schema["$id"].endswith(f":{name}.json")
    assert "discriminator" not in _keywords(schema)
    assert not any(schema_format in json.dumps(schema) for schema_format in ('"format": "date-time"',))


def test_ids_are_unique() -> None:
    ids = [_schema(name)["$id"] for name in SCHEMA_NAMES]
    assert len(set(ids)) == len(ids)


def test_portable_drops_openapi_keywords_and_keeps_properties_named_like_them() -> None:
    schema = {
        "oneOf": [{"$ref": "#/$defs/A"}],
        "discriminator": {"propertyName": "kind", "mapping": {"a": "#/$defs/A"}},
        "$defs": {
            "A": {
                "type": "object",
                "properties": {
                    "format": {"enum": ["json"], "default": {"format": "date-time"}},
                    "discriminator": {"type": "string"},
                    "at": {"type": "string", "format": "date-time", "pattern": "^[0-9]+$"},
                },
            }
        },
    }
    result = portable(schema)
    assert "discriminator" not in result
    properties = result["$defs"]["A"]["properties"]
    assert set(properties) == {"format", "discriminator", "at"}
    assert properties["format"]["default"] == {"format": "date-time"}  # data is kept as it is
    assert properties["at"] == {"type": "string", "pattern": "^[0-9]+$"}
    assert OPENAPI_ONLY_KEYWORDS == {"discriminator"} and "date-time" in UNDECLARED_FORMATS


def test_portable_refuses_a_format_it_would_lose() -> None:
    with pytest.raises(ValueError, match="date-time"):
        portable({"type": "string", "format": "date-time"})


def test_template_onboarding_keeps_its_date_check() -> None:
    validator = _validator("TemplateOnboarding")
    at = validator.schema["properties"]["onboardedAt"]
    assert at["pattern"] and "format" not in at
    assert list(Draft202012Validator(at).iter_errors("2026-01-02T03:04:05Z")) == []
    assert list(Draft202012Validator(at).iter_errors("yesterday")) != []


class _Recorder:
    """Wraps a ControlSession: every frame it sends and receives."""

    def __init__(self, session: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        send, receive = session.send, session.receive

        async def recording_send(kind: str, body: Any, *, generation: int | None = None) -> None:
            self.sent.append({"kind": kind, "connectionGeneration": generation or session.generation, "body": body})
            await send(kind, body, generation=generation)

        async def recording_receive(timeout: float = 10.0) -> dict[str, Any]:
            frame: dict[str, Any] = await receive(timeout)
            self.received.append(frame)
            return frame

        session.send = recording_send
        session.receive = recording_receive


async def test_every_frame_of_a_real_session_is_valid(daemon: Any) -> None:
    (daemon.layout.workspace / "a.txt").write_text("hello\n")
    async with daemon.client().connect() as session:
        recorder = _Recorder(session)
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        ok = await session.call_and_wait("read_file", {"path": "a.txt"})
        assert ok["ok"] is True
        assert (await session.call_and_wait("read_file", {"path": "none.txt"}))["ok"] is False
        shell = await session.call("execute_shell_command", {"command": "echo hi; echo err >&2"}, idempotency_key="v-1")
        assert (await session.result(shell))["ok"] is True
        retry = await session.call("execute_shell_command", {"command": "echo hi; echo err >&2"}, idempotency_key="v-1")
        await session.result(retry)
        await session.read_output(shell, "stdout", 0, 100)
        await session.read_output(shell, "stderr", 0, 100, binary=True)
        await session.send("exec.read_output", {"call_id": CALL_ID, "stream": "stdout", "offset": 0, "length": 1})
        await session.receive_until(lambda f: f["kind"] == "error")
        process = await session.call("start_process", {"command": "cat", "pty": {"rows": 5, "cols": 20}}, idempotency_key="v-2")
        assert (await session.result(process))["ok"] is True
        await session.write_stdin(process, 0, b"x\n")
        await session.send("exec.resize", {"call_id": process, "rows": 6, "cols": 30})
        await session.list_processes()
        await session.send("exec.signal", {"call_id": process, "signal": "SIGKILL"})
        await session.exec_completed(process)
        await session.call("read_file", {"path": "a.txt", "unknown": 1})
        await session.receive_until(lambda f: f["kind"] == "tool.result" and f["body"]["ok"] is False)
        await session.ack()

    server, header, client = _validator("ServerFrame"), _validator("ExecOutputPageHeader"), _validator("ClientFrame")
    kinds = set()
    for frame in recorder.received:
        if isinstance(frame.get("data"), bytes):  # a binary page: its header is the frame
            header.validate({key: value for key, value in frame.items() if key != "data"})
            kinds.add("binary page")
        else:
            server.validate(frame)
            kinds.add(frame["kind"])
    assert {
        "runtime.state", "tool.result", "tool.replayed", "exec.started", "exec.output", "exec.completed",
        "exec.output_page", "binary page", "error", "exec.stdin_ack", "exec.processes",
    } <= kinds
    for frame in recorder.sent:
        client.validate(frame)
    call_bodies = _validator("ToolCallBody")
    for frame in recorder.sent:
        if frame["kind"] == "tool.call" and "unknown" not in frame["body"]["parameters"]:
            call_bodies.validate(frame["body"])
    # Each ok result is valid against its tool's result schema.
    results = {spec.name: _validator(spec.result.__name__) for spec in tools.TOOL_SPECS}
    for frame in recorder.received:
        if frame.get("kind") == "tool.result" and frame["body"]["ok"]:
            results[frame["body"]["tool_name"]].validate(frame["body"]["result"])


def _encoded(frame: Any) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(frames.encode_frame(frame))
    return decoded


def _invalid(frame: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(frame)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


def test_frames_the_models_refuse_are_refused() -> None:
    server, client, calls = _validator("ServerFrame"), _validator("ClientFrame"), _validator("ToolCallBody")
    error = _encoded(frames.ErrorFrame(body=frames.ErrorBody(code="not_running", message="The command has finished.", call_id=CALL_ID)))
    withheld = json.loads(frames.encode_withheld(14))
    page = _encoded(
        frames.ExecOutputPageFrame(
            body=frames.ExecOutputPageBody(call_id=CALL_ID, stream="stdout", offset=0, data="aGkK", eof=True, truncated=False)
        )
    )
    ack = {"kind": "events.ack", "connectionGeneration": 3, "body": {"seq": 9}}
    call = {"tool_name": "read_file", "call_id": CALL_ID, "parameters": {"path": "a.txt"}}
    for valid, validator in ((error, server), (withheld, server), (page, server), (ack, client), (call, calls)):
        validator.validate(valid)
    refused = [
        (server, _invalid(error, ("body", "extra"), 1)),  # closed bodies
        (server, _invalid(error, ("body", "call_id"), "not-a-uuid")),
        (server, _invalid(withheld, ("seq",), 0)),  # seqs start at 1
        (server, _invalid(page, ("body", "data"), "not base64!")),
        (server, _invalid(page, ("kind",), "exec.output_pages")),  # no such kind
        (client, _invalid(ack, ("connectionGeneration",), 0)),
        (client, _invalid(ack, ("body", "seq"), True)),  # strict: a boolean is no integer
        (client, {**ack, "kind": "runtime.state"}),  # a server kind
        (calls, _invalid(call, ("tool_name",), "execute_shell_command")),  # parameters of another tool
        (calls, _invalid(call, ("parameters", "length"), 0)),
    ]
    for validator, frame in refused:
        assert not validator.is_valid(frame), frame
        with pytest.raises(ValueError):  # the models refuse the same frame (FrameError, ToolCallError)
            if validator is client:
                frames.decode_client_frame(json.dumps(frame))
            elif validator is server:
                frames.decode_server_frame(json.dumps(frame))
            else:
                tools.parse_tool_call(frame)
