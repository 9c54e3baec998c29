"""Adversarial review of the direct-I/O fast paths: what the replaced library layers
guaranteed, held against the code that bypasses them (supervisor/runtime/held.py,
supervisor/edge/server.py, supervisor/session/sender.py). Real daemons, holders, sockets."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
from collections.abc import Callable

import trio

from sandbox_supervisor.daemon.runtime.holder_protocol import read_holder
from sandbox_supervisor.daemon.runtime.spool import spool_dir

DEADLINE_S = 20


async def until(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def start(session, command: str, key: str) -> str:
    call_id = await session.call("start_process", {"command": command}, idempotency_key=key)
    result = await session.result(call_id)
    assert result["ok"], result
    return call_id


async def test_a_stdin_request_cut_off_by_a_newer_connection_does_not_shift_later_answers(daemon):
    """The holder link answers requests in order. A request given up on (its socket was
    superseded while the holder was slow) still gets its answer from the holder later; taking
    that answer for the next request's would shift every answer after it by one."""
    client = daemon.client()
    async with client.connect() as first:
        await first.bootstrap(cwd=str(daemon.layout.workspace))
        call_id = await start(first, "cat", "p-cat")
        holder = read_holder(spool_dir(daemon.layout.state_dir, call_id))
        assert holder is not None
        link = daemon.supervisor.processes.processes[call_id].link
        assert link is not None
        os.kill(holder.holder_pid, signal.SIGSTOP)  # the holder answers nothing for now
        try:
            body = {"call_id": call_id, "offset": 0, "data": base64.b64encode(b"a\n").decode(), "request_id": "r-cut"}
            await first.send("exec.write_stdin", body)
            await until(link._lock.locked)  # the request is with the holder, its answer awaited
            async with client.connect() as second:  # supersedes `first`: its request is cancelled
                await second.bootstrap(cwd=str(daemon.layout.workspace))
                await until(lambda: not link._lock.locked())
                os.kill(holder.holder_pid, signal.SIGCONT)
                # The first request reached the holder: "a\n" is written, and this one follows it.
                assert (await second.write_stdin(call_id, 2, b"b\n"))["next_offset"] == 4
                assert (await second.write_stdin(call_id, 4, b"c\n"))["next_offset"] == 6
                closed = await second.close_stdin(call_id, 6)
                assert closed["closed"] is True and closed["next_offset"] == 6
                body = await second.exec_completed(call_id, timeout=DEADLINE_S)
                assert body["exit_code"] == 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # ended with its process
                os.kill(holder.holder_pid, signal.SIGCONT)
