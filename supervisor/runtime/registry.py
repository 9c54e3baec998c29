"""The tool registry: one module per tool (under runtime/tools/), listed once here.

Each module declares `NAME`, `bind(services) -> Tool` (how it runs) and `recover` (how a call
it left pending is completed after a crash, or None: reported interrupted, never re-run).
Adding a tool: its wire half in `protocol/tools.py` (models, the ToolName and ToolCallBody
entries, one TOOL_SPECS row; the JSON Schemas and docs/codes.md follow from them), its module
under runtime/tools/, one line in `TOOL_MODULES`, and its section in docs/protocol.md.
"""

from __future__ import annotations

from sandbox_supervisor.protocol.tools import TOOL_NAMES
from sandbox_supervisor.daemon.runtime.tool import Recover, Tool, ToolModule, ToolServices
from sandbox_supervisor.daemon.runtime.tools import apply_file_patch, execute_shell_command, read_file, start_process

TOOL_MODULES: tuple[ToolModule, ...] = (apply_file_patch, execute_shell_command, read_file, start_process)


class RegistryMismatch(Exception):
    """The registry and the protocol disagree on the tools (a bug: the daemon refuses to start)."""


def bind_tools(services: ToolServices) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for module in TOOL_MODULES:
        tool = module.bind(services)
        tools[tool.name] = tool
    # Every tool the protocol accepts must be runnable, and nothing else: a call that passed
    # parse_tool_call must find its tool here.
    if set(tools) != set(TOOL_NAMES):
        raise RegistryMismatch(f"registry has {sorted(tools)}, the protocol {sorted(TOOL_NAMES)}")
    return tools


def recoverers() -> dict[str, Recover | None]:
    return {module.NAME: module.recover for module in TOOL_MODULES}
