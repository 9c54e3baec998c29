"""What tests that drive ShellRuntime directly share: its settings for a rig, and an
execute_shell_command call as the CallRunner would hand it over (a fresh call_id and key,
the control plane's context)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from sandbox_supervisor.protocol.tools import parse_tool_call
from sandbox_supervisor.daemon.runtime.shell import ShellSettings
from sandbox_supervisor.daemon.runtime.tool import CallContext, RunningCall


def rig_settings(state_dir: Path, **overrides: Any) -> ShellSettings:
    """Small limits and a short throttle, so a test sees the runtime's behaviour quickly."""
    settings: dict[str, Any] = {
        "shell": "/bin/sh",
        "max_processes": 4,
        "kill_grace_s": 2.0,
        "throttle_ms": 10,
        "max_chunk_bytes": 4096,
        "buffer_bytes": 65536,
        "spool_max_bytes": 1 << 20,
        "spool_total_max_bytes": 1 << 30,
        "base_env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        "state_dir": state_dir,
    }
    settings.update(overrides)
    return ShellSettings(**settings)


def shell_call(workspace: Path, command: str, **params: Any) -> RunningCall:
    return command_call(workspace, "execute_shell_command", command, **params)


def command_call(workspace: Path, tool_name: str, command: str, **params: Any) -> RunningCall:
    """A call of a command tool (execute_shell_command, start_process) with a fresh call_id
    and key, in the control plane's context."""
    call = parse_tool_call(
        {
            "tool_name": tool_name,
            "call_id": str(uuid.uuid4()),
            "idempotency_key": f"k-{uuid.uuid4()}",
            "parameters": {"command": command, **params},
        }
    )
    context = CallContext(
        session_id="session-1",
        generation=1,
        cwd=str(workspace),
        agent_env={},
        scopes=frozenset({"shell:exec"}),
        allowed_paths=None,
        allowed_commands=None,
    )
    return RunningCall(call, context)
