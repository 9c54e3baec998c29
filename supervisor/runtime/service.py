"""The runtime as the session layer sees it: tool calls and the exec.* frames
(`session.socket.RuntimePort`, implemented structurally: the runtime imports no session code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import (
    ErrorBody,
    ErrorFrame,
    ExecOutputPageBody,
    ExecOutputPageFrame,
    ExecReadOutputFrame,
    ExecSignalFrame,
)
from sandbox_supervisor.daemon.runtime.audience import audience_for
from sandbox_supervisor.daemon.runtime.calls import CallRunner
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.runtime.tool import CallContext, SendReply
from sandbox_supervisor.daemon.state.visibility import Audience

UNKNOWN_CALL_MESSAGE = "No such command call."
NOT_RUNNING_MESSAGE = "The command has finished."


class Runtime:
    def __init__(self, calls: CallRunner, shell: ShellRuntime) -> None:
        self.calls = calls
        self.shell = shell

    async def submit_call(
        self, body: dict[str, Any], context: CallContext, reply: SendReply, may_act: Callable[[], bool]
    ) -> None:
        await self.calls.submit(body, context, reply, may_act)

    def audience(
        self,
        scopes: Iterable[str],
        allowed_paths: Sequence[str] | None,
        allowed_commands: Sequence[str] | None,
        cwd: str,
    ) -> Audience:
        """What a socket with these claims may see (docs/protocol.md §9.1), its allowed_paths
        resolved by the jail's walk from the opened agent.cwd."""
        return audience_for(self.calls.roots, scopes, allowed_paths, allowed_commands, cwd)

    def exec_frame(self, frame: ExecSignalFrame | ExecReadOutputFrame) -> ErrorFrame | ExecOutputPageFrame | None:
        """exec.signal (an error, or nothing once sent) and exec.read_output (a page, or an
        error) — docs/protocol.md §7.4.6, §7.4.7."""
        body = frame.body
        if isinstance(frame, ExecSignalFrame):
            code = self.shell.signal_command(frame.body.call_id, frame.body.signal)
            if code is None:
                return None
            message = UNKNOWN_CALL_MESSAGE if code == errors.UNKNOWN_CALL else NOT_RUNNING_MESSAGE
            return ErrorFrame(body=ErrorBody(code=code, message=message, call_id=body.call_id))
        read = frame.body
        page = self.shell.read_output(read.call_id, read.stream, read.offset, read.length)
        if page is None:
            return ErrorFrame(body=ErrorBody(code=errors.UNKNOWN_CALL, message=UNKNOWN_CALL_MESSAGE, call_id=read.call_id))
        return ExecOutputPageFrame(body=ExecOutputPageBody.model_validate(page))
