"""The runtime as the session layer sees it: tool calls and the exec.* frames
(`session.socket.RuntimePort`, implemented structurally: the runtime imports no session code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import base64
from typing import Any

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import (
    ErrorBody,
    ErrorFrame,
    ExecCloseStdinFrame,
    ExecFrame,
    ExecListFrame,
    ExecOutputPageBody,
    ExecOutputPageFrame,
    ExecOutputPageHeaderBody,
    ExecProcessesBody,
    ExecProcessesFrame,
    ExecReadOutputBody,
    ExecReadOutputFrame,
    ExecResizeFrame,
    ExecSignalFrame,
    ExecWriteStdinFrame,
    ServerFrameModel,
    binary_page_parts,
    encode_stdin_ack,
)
from sandbox_supervisor.daemon.runtime.audience import audience_for
from sandbox_supervisor.daemon.websocket import Outgoing
from sandbox_supervisor.daemon.runtime.calls import CallRunner
from sandbox_supervisor.daemon.runtime.held import HeldProcess
from sandbox_supervisor.daemon.runtime.process_host import ProcessHost
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.runtime.tool import CallContext, SendReply
from sandbox_supervisor.daemon.state.visibility import Audience

UNKNOWN_CALL_MESSAGE = "No such command call."
NOT_RUNNING_MESSAGE = "The command has finished."
NOT_A_TERMINAL_MESSAGE = "The process has no terminal."
HOLDER_FAILED_MESSAGE = "The process's holder did not answer."


class Runtime:
    def __init__(self, calls: CallRunner, shell: ShellRuntime, processes: ProcessHost | None = None) -> None:
        self.calls = calls
        self.shell = shell
        self.processes = processes

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

    async def exec_frame(self, frame: ExecFrame, audience: Audience | None = None) -> ServerFrameModel | Outgoing | None:
        """The exec.* frames (docs/protocol.md §7.4.6, §7.4.7, §7.7): an answer frame, a
        binary message (a binary exec.output_page, §6.5.1), or None (a signal sent, a resize
        done). `audience`: what the sending socket may see;
        it acts only on processes it may see."""
        if isinstance(frame, ExecListFrame):
            listed = [] if self.processes is None else self.processes.listing(audience)
            return ExecProcessesFrame(
                body=ExecProcessesBody.model_validate({"processes": listed, "request_id": frame.body.request_id})
            )
        call_id = frame.body.call_id
        request_id = frame.body.request_id  # echoed in every answer (docs/protocol.md §6.3)
        seen: bool | None  # an ended held process the socket may see (None: not a held one)
        if self.processes is not None:
            held = self.processes.find(call_id)
            if held is not None:
                if not self.processes.may_act(held, audience):
                    return _error(errors.UNKNOWN_CALL, call_id, request_id)
                return await self._held_frame(self.processes, held, frame)
            seen = self.processes.may_see_ended(call_id, audience)
        else:
            seen = None
        if seen is False or (seen is None and not self.shell.may_see(call_id, audience)):
            return _error(errors.UNKNOWN_CALL, call_id, request_id)  # as for a call that does not exist
        if isinstance(frame, ExecSignalFrame):
            code = self.shell.signal_command(call_id, frame.body.signal)
            return None if code is None else _error(code, call_id, request_id)
        if isinstance(frame, ExecReadOutputFrame):
            return self._page(frame.body, None)
        # stdin and resize exist only for held processes; a command's stdin is /dev/null.
        code = errors.NOT_RUNNING if self.shell.known_call(call_id) else errors.UNKNOWN_CALL
        return _error(code, call_id, request_id)

    def _page(self, read: ExecReadOutputBody, writer_alive: bool | None) -> ServerFrameModel | Outgoing:
        """exec.read_output's answer: the page as JSON (base64), or as a binary message when
        the request asks for one (no base64, no JSON string: docs/protocol.md §6.5.1)."""
        page = self.shell.read_page(read.call_id, read.stream, read.offset, read.length, writer_alive=writer_alive)
        if page is None:
            return _error(errors.UNKNOWN_CALL, read.call_id, read.request_id)
        if read.binary:
            header = ExecOutputPageHeaderBody(
                call_id=read.call_id,
                stream=read.stream,
                offset=read.offset,
                bytes=len(page.data),
                eof=page.eof,
                truncated=page.truncated,
                request_id=read.request_id,
            )
            # In two parts, written without joining them (binary_page_parts).
            return binary_page_parts(header, page.data)
        body = {
            "call_id": read.call_id,
            "stream": read.stream,
            "offset": read.offset,
            "data": base64.b64encode(page.data).decode("ascii"),
            "eof": page.eof,
            "truncated": page.truncated,
            "request_id": read.request_id,
        }
        return ExecOutputPageFrame(body=ExecOutputPageBody.model_validate(body))

    async def _held_frame(self, processes: ProcessHost, held: HeldProcess, frame: ExecFrame) -> ServerFrameModel | Outgoing | None:
        call_id = held.call_id
        request_id = frame.body.request_id
        if isinstance(frame, ExecReadOutputFrame):
            return self._page(frame.body, held.exit is None)
        if isinstance(frame, ExecSignalFrame):
            code = await processes.send_signal(held, frame.body.signal)
        elif isinstance(frame, ExecResizeFrame):
            code = await processes.resize(held, frame.body.rows, frame.body.cols)
        elif isinstance(frame, ExecWriteStdinFrame):
            # Decodable and within MAX_STDIN_WRITE_BYTES: the frame model checked both.
            data = base64.b64decode(frame.body.data)
            ack = await processes.write_stdin(held, frame.body.offset, data)
            return _stdin_answer(ack, call_id, request_id)
        else:
            assert isinstance(frame, ExecCloseStdinFrame)
            ack = await processes.close_stdin(held, frame.body.offset)
            return _stdin_answer(ack, call_id, request_id)
        return None if code is None else _error(code, call_id, request_id)


_MESSAGES = {
    errors.UNKNOWN_CALL: UNKNOWN_CALL_MESSAGE,
    errors.NOT_RUNNING: NOT_RUNNING_MESSAGE,
    errors.NOT_A_TERMINAL: NOT_A_TERMINAL_MESSAGE,
}


def _error(code: str, call_id: str, request_id: str | None, message: str | None = None) -> ErrorFrame:
    text = message if message is not None else _MESSAGES.get(code, HOLDER_FAILED_MESSAGE)
    if code not in _MESSAGES and message is None:
        code = errors.INTERNAL
    return ErrorFrame(body=ErrorBody(code=code, message=text, call_id=call_id, request_id=request_id))


def _stdin_answer(ack: str | dict[str, Any], call_id: str, request_id: str | None) -> ServerFrameModel | str:
    """exec.stdin_ack, already encoded (one per keystroke: the direct encoder), or the error
    code a stdin frame was refused with."""
    if isinstance(ack, str):
        return _error(ack, call_id, request_id)
    return encode_stdin_ack(ack["call_id"], ack["offset"], ack["next_offset"], ack["closed"], request_id)
