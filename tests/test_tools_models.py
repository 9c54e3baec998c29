"""Tool-call models and parse_tool_call (docs/protocol.md §7.1)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.errors import INVALID_FRAME, INVALID_PARAMETERS
from sandbox_supervisor.protocol.tools import (
    TOOL_NAMES,
    TOOL_SCOPES,
    ApplyFilePatchCall,
    ApplyFilePatchParams,
    ExecuteShellCommandCall,
    ExecuteShellCommandParams,
    ReadFileCall,
    ReadFileParams,
    ToolCall,
    ToolCallError,
    call_digest,
    parse_tool_call,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings

CALL_ID = "0b9d2f4e-1c3a-4e5f-8a7b-6c5d4e3f2a1b"
SHA = "3b18e512dba79e4c8300dd08aeb37f8e728b8dad"

PARAMETERS: dict[str, dict[str, Any]] = {
    "apply_file_patch": {"path": "src/a.py", "diff": "--- a\n+++ b\n", "base_sha": SHA},
    "execute_shell_command": {"command": "echo hi"},
    "read_file": {"path": "README.md"},
    "start_process": {"command": "npm run dev", "pty": {"rows": 24, "cols": 80, "term": "xterm-256color"}},
}


def call(tool_name: str = "execute_shell_command", **changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "tool_name": tool_name,
        "call_id": CALL_ID,
        "idempotency_key": "key-1",
        "parameters": dict(PARAMETERS.get(tool_name, {})),
    }
    for name, value in changes.items():
        if value is DROP:
            document.pop(name)
        else:
            document[name] = value
    return document


DROP = object()


def with_params(tool_name: str, **params: Any) -> dict[str, Any]:
    return call(tool_name, parameters=PARAMETERS[tool_name] | params)


def refused(body: Any) -> ToolCallError:
    with pytest.raises(ToolCallError) as caught:
        parse_tool_call(body)
    return caught.value


def test_every_tool_has_a_scope_and_a_sample() -> None:
    assert set(TOOL_SCOPES) == set(TOOL_NAMES) == set(PARAMETERS)
    assert set(TOOL_SCOPES.values()) == {"files:read", "files:write", "shell:exec"}


@pytest.mark.parametrize(
    ("tool_name", "model", "params_model"),
    [
        ("apply_file_patch", ApplyFilePatchCall, ApplyFilePatchParams),
        ("execute_shell_command", ExecuteShellCommandCall, ExecuteShellCommandParams),
        ("read_file", ReadFileCall, ReadFileParams),
    ],
)
def test_each_tool_parses_to_its_models(tool_name: str, model: type, params_model: type) -> None:
    parsed = parse_tool_call(call(tool_name))
    assert type(parsed) is model and isinstance(parsed, ToolCall)
    assert type(parsed.parameters) is params_model
    assert (parsed.tool_name, parsed.call_id, parsed.idempotency_key) == (
        tool_name,
        CALL_ID,
        "key-1",
    )


def test_defaults_are_filled_in() -> None:
    shell = parse_tool_call(call("execute_shell_command")).parameters
    assert (shell.timeout_ms, shell.cwd, shell.env) == (30000, None, None)
    read = parse_tool_call(call("read_file")).parameters
    assert (read.offset, read.length) == (0, None)


def test_call_id_is_kept_exactly_as_given() -> None:
    upper = CALL_ID.upper()
    assert parse_tool_call(call(call_id=upper)).call_id == upper


@pytest.mark.parametrize(
    "call_id",
    [
        DROP,
        None,
        5,
        "",
        "not-a-uuid",
        CALL_ID.replace("-", ""),
        "{" + CALL_ID + "}",
        f"urn:uuid:{CALL_ID}",
    ],
)
def test_unreadable_call_id_is_invalid_frame_without_call_id(call_id: object) -> None:
    error = refused(call(call_id=call_id))
    assert (error.code, error.call_id) == (INVALID_FRAME, None)


@pytest.mark.parametrize("body", [None, [], "x", 1])
def test_a_body_that_is_not_an_object_is_invalid_frame(body: object) -> None:
    assert refused(body).code == INVALID_FRAME


@pytest.mark.parametrize("tool_name", ["delete_everything", "", 5, None, DROP, "READ_FILE"])
def test_unknown_tool_is_invalid_parameters_for_a_readable_call(tool_name: object) -> None:
    error = refused(call(tool_name=tool_name))
    assert (error.code, error.call_id) == (INVALID_PARAMETERS, CALL_ID)
    assert error.tool_name == (tool_name if isinstance(tool_name, str) and tool_name else None)
    assert error.idempotency_key == "key-1"


@pytest.mark.parametrize("tool_name", ["apply_file_patch", "execute_shell_command"])
@pytest.mark.parametrize("key", [DROP, None, "", "k" * 129, 7])
def test_patch_and_shell_need_an_idempotency_key(tool_name: str, key: object) -> None:
    error = refused(call(tool_name, idempotency_key=key))
    assert (error.code, error.call_id, error.tool_name) == (INVALID_PARAMETERS, CALL_ID, tool_name)
    # Echoed only when it is a key the protocol would accept as such.
    assert error.idempotency_key is None


@pytest.mark.parametrize("key", [DROP, None])
def test_read_file_key_is_optional(key: object) -> None:
    assert parse_tool_call(call("read_file", idempotency_key=key)).idempotency_key is None


def test_read_file_key_is_honoured_when_given() -> None:
    assert (
        parse_tool_call(call("read_file", idempotency_key="k" * 128)).idempotency_key == "k" * 128
    )


@pytest.mark.parametrize(
    ("tool_name", "params"),
    [
        ("apply_file_patch", {"path": ""}),
        ("apply_file_patch", {"path": "a" * 4097}),
        ("apply_file_patch", {"path": "a\x00b"}),
        ("apply_file_patch", {"base_sha": SHA.upper()}),
        ("apply_file_patch", {"base_sha": SHA[:-1]}),
        ("apply_file_patch", {"diff": None}),
        ("execute_shell_command", {"command": ""}),
        ("execute_shell_command", {"command": "x" * 16385}),
        ("execute_shell_command", {"timeout_ms": 0}),
        ("execute_shell_command", {"timeout_ms": 60001}),
        ("execute_shell_command", {"timeout_ms": True}),
        ("execute_shell_command", {"timeout_ms": 1000.0}),
        ("execute_shell_command", {"timeout_ms": "1000"}),
        ("execute_shell_command", {"cwd": ""}),
        ("execute_shell_command", {"env": {"lower": "x"}}),
        ("execute_shell_command", {"env": {f"V{i}": "x" for i in range(65)}}),
        ("execute_shell_command", {"env": {"A": 1}}),
        ("read_file", {"offset": -1}),
        ("read_file", {"length": 0}),
        ("read_file", {"length": 65537}),
        ("read_file", {"unknown": 1}),
        ("execute_shell_command", {"unknown": 1}),
        ("apply_file_patch", {"unknown": 1}),
    ],
)
def test_bad_parameters_are_invalid_parameters(tool_name: str, params: dict[str, Any]) -> None:
    error = refused(with_params(tool_name, **params))
    assert (error.code, error.call_id, error.tool_name) == (INVALID_PARAMETERS, CALL_ID, tool_name)
    assert error.message.endswith(".")


@pytest.mark.parametrize(
    ("tool_name", "params"),
    [
        ("execute_shell_command", {"timeout_ms": 1, "cwd": "sub/dir", "env": {"A": "b"}}),
        ("execute_shell_command", {"timeout_ms": 60000, "command": "x" * 16384}),
        ("read_file", {"offset": 10, "length": 65536}),
        ("apply_file_patch", {"path": "a" * 4096, "base_sha": "0" * 40}),
    ],
)
def test_parameters_at_their_limits_are_accepted(tool_name: str, params: dict[str, Any]) -> None:
    parsed = parse_tool_call(with_params(tool_name, **params))
    assert parsed.parameters.model_dump(include=set(params)) == params


def test_parameters_are_chosen_by_tool_name_never_by_shape() -> None:
    # A perfectly good read_file parameter set under another tool's name is not "guessed".
    error = refused(call("execute_shell_command", parameters=PARAMETERS["read_file"]))
    assert error.code == INVALID_PARAMETERS
    error = refused(call("read_file", parameters=PARAMETERS["apply_file_patch"]))
    assert error.code == INVALID_PARAMETERS


@pytest.mark.parametrize("parameters", [DROP, None, [], "x"])
def test_missing_or_non_object_parameters_are_invalid_parameters(parameters: object) -> None:
    assert refused(call(parameters=parameters)).code == INVALID_PARAMETERS


def test_unknown_envelope_field_is_invalid_parameters() -> None:
    error = refused(call(extra=True))
    assert (error.code, error.call_id) == (INVALID_PARAMETERS, CALL_ID)


def test_message_names_the_field_without_the_tool_tag() -> None:
    error = refused(with_params("execute_shell_command", timeout_ms=60001))
    assert error.message.startswith("Invalid tool call: parameters.timeout_ms:")


def test_long_tool_names_are_not_echoed() -> None:
    assert refused(call(tool_name="x" * 1000)).tool_name is None


# ------------------------------- digest -------------------------------


def test_call_digest_is_sha256_of_the_canonical_pair() -> None:
    params = ReadFileParams(path="a", offset=1)
    canonical = '["read_file",{"offset":1,"path":"a"}]'
    assert call_digest("read_file", params) == hashlib.sha256(canonical.encode()).hexdigest()


def test_call_digest_ignores_parameter_order() -> None:
    one = parse_tool_call(
        call(parameters={"command": "ls", "timeout_ms": 5, "env": {"A": "1", "B": "2"}})
    )
    two = parse_tool_call(
        call(
            parameters=json.loads('{"env": {"B": "2", "A": "1"}, "timeout_ms": 5, "command": "ls"}')
        )
    )
    assert call_digest(one.tool_name, one.parameters) == call_digest(two.tool_name, two.parameters)


def test_call_digest_treats_explicit_defaults_as_omitted() -> None:
    implicit = parse_tool_call(call(parameters={"command": "ls"})).parameters
    explicit = parse_tool_call(
        call(parameters={"command": "ls", "timeout_ms": 30000, "cwd": None})
    ).parameters
    assert call_digest("execute_shell_command", implicit) == call_digest(
        "execute_shell_command", explicit
    )


def test_call_digest_changes_with_tool_and_values() -> None:
    params = ReadFileParams(path="a")
    digests = {
        call_digest("read_file", params),
        call_digest("apply_file_patch", params),
        call_digest("read_file", ReadFileParams(path="b")),
        call_digest("read_file", ReadFileParams(path="a", length=1)),
    }
    assert len(digests) == 4


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)


@pytest.mark.fuzz
@fuzz_settings(500)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "tool_name": st.sampled_from(TOOL_NAMES) | _json_values,
            "call_id": st.just(CALL_ID) | _json_values,
            "idempotency_key": st.just("k") | _json_values,
            "parameters": st.sampled_from(list(PARAMETERS.values())) | _json_values,
            "extra": _json_values,
        },
    )
    | _json_values
)
def test_arbitrary_bodies_raise_only_tool_call_error(body: Any) -> None:
    try:
        parsed = parse_tool_call(body)
    except ToolCallError as error:
        assert error.code in {INVALID_FRAME, INVALID_PARAMETERS}
        assert (error.call_id is None) == (error.code == INVALID_FRAME)
    else:
        assert parsed.call_id == CALL_ID
