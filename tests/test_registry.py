"""The tool registry against the protocol: every tool the wire accepts is runnable, with the
protocol's own parameter model, and each module's name is its tool's."""

from __future__ import annotations

import typing

import pytest
import trio

from pathlib import Path

from sandbox_supervisor.protocol import tools as wire
from sandbox_supervisor.daemon.runtime import registry
from sandbox_supervisor.daemon.runtime.registry import RegistryMismatch, bind_tools, recoverers
from sandbox_supervisor.daemon.runtime.tool import ToolServices

SCHEMAS = Path(wire.__file__).parent / "schemas"
CALL_MODELS = {
    typing.get_args(model.model_fields["tool_name"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(wire.ToolCallBody)[0])
}


def services() -> ToolServices:
    return ToolServices(store=None, file_write_lock=trio.Lock(), shell=None)  # type: ignore[arg-type]


def test_the_registry_binds_exactly_the_protocols_tools_with_its_models():
    tools = bind_tools(services())
    assert set(tools) == set(wire.TOOL_NAMES) == set(CALL_MODELS)
    for name, tool in tools.items():
        assert tool.spec is wire.tool_spec(name)
        assert tool.spec.call is CALL_MODELS[name]
        assert tool.spec.parameters is CALL_MODELS[name].model_fields["parameters"].annotation
        assert tool.scope == wire.TOOL_SCOPES[name]


def test_the_protocols_tool_table_agrees_with_its_static_types():
    # ToolName and ToolCallBody are spelled out for the type checker; TOOL_SPECS is the table
    # everything else derives from. Adding a tool to one and not the others fails here.
    assert tuple(spec.name for spec in wire.TOOL_SPECS) == wire.TOOL_NAMES
    assert {spec.call for spec in wire.TOOL_SPECS} == set(CALL_MODELS.values())
    for spec in wire.TOOL_SPECS:
        assert spec.result.__name__ in {path.stem for path in SCHEMAS.glob("*.json")}  # exported
    assert set(recoverers()) == set(wire.TOOL_NAMES)


def test_a_registry_missing_a_tool_refuses_to_bind(monkeypatch):
    monkeypatch.setattr(registry, "TOOL_MODULES", registry.TOOL_MODULES[:-1])
    with pytest.raises(RegistryMismatch):
        bind_tools(services())
