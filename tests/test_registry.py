"""The tool registry against the protocol: every tool the wire accepts is runnable, with the
protocol's own parameter model, and each module's name is its tool's."""

from __future__ import annotations

import typing

import pytest
import trio

from sandbox_supervisor.protocol import frames
from sandbox_supervisor.protocol import tools as wire
from sandbox_supervisor.daemon.runtime import registry
from sandbox_supervisor.daemon.runtime.registry import RegistryMismatch, bind_tools, recoverers
from sandbox_supervisor.daemon.runtime.tool import ToolServices

CALL_MODELS = {
    typing.get_args(model.model_fields["tool_name"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(wire.ToolCallBody)[0])
}


def services() -> ToolServices:
    return ToolServices(store=None, file_write_lock=trio.Lock(), shell=None)  # type: ignore[arg-type]


def test_the_registry_binds_exactly_the_protocols_tools_with_its_models():
    tools = bind_tools(services())
    assert set(tools) == set(wire.TOOL_NAMES) == set(CALL_MODELS)
    results = {"read_file": frames.ReadFileResult, "apply_file_patch": frames.PatchResult,
               "execute_shell_command": frames.ShellResult}
    for name, tool in tools.items():
        assert tool.params is CALL_MODELS[name].model_fields["parameters"].annotation
        assert tool.result is results[name]  # the model its results are documented by
        assert tool.scope == wire.TOOL_SCOPES[name]
    assert set(recoverers()) == set(wire.TOOL_NAMES)


def test_a_registry_missing_a_tool_refuses_to_bind(monkeypatch):
    monkeypatch.setattr(registry, "TOOL_MODULES", registry.TOOL_MODULES[:-1])
    with pytest.raises(RegistryMismatch):
        bind_tools(services())
