"""What tests that drive ShellRuntime directly share: an execute_shell_command call as the
CallRunner would hand it over (a fresh call_id and key, the control plane's context)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from sandbox_supervisor.protocol.tools import parse_tool_call
from sandbox_supervisor.daemon.runtime.tool import CallContext, RunningCall


def shell_call(workspace: Path, command: str, **params: Any) -> RunningCall:
    call = parse_tool_call(
        {
            "tool_name": "execute_shell_command",
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
