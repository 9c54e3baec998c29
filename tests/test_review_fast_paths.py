"""Adversarial review of the direct-I/O fast paths: what the replaced library layers
guaranteed, held against the code that bypasses them (supervisor/runtime/held.py,
supervisor/edge/server.py, supervisor/session/sender.py). Real daemons, holders, sockets."""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import signal
import socket
import sqlite3
from collections.abc import Callable

import pytest
import trio
import trio.testing

from sandbox_supervisor.daemon.runtime.held import HolderLink
from sandbox_supervisor.daemon.runtime.holder_protocol import MAX_LINE_BYTES, Reply, encode_watch, read_holder
from sandbox_supervisor.daemon.runtime.spool import spool_dir
from sandbox_supervisor.testing.daemon import BUG_EVENTS

DEADLINE_S = 20
# The daemon's end of a holder link in the tests that fill it: small, so a line is cut.
LINK_SEND_BUFFER = 16 * 1024
# How long the stand-in holder waits for more of a request before it takes the link to have
# stopped short (without the fix the rest never comes).
QUIET_S = 2.0


async def until(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def crashes(lines: list[dict]) -> list[dict]:
    """Log lines of a crash the daemon contained (testing/daemon.py BUG_EVENTS)."""
    return [line for line in lines if line.get("event") in BUG_EVENTS]


async def start(session, command: str, key: str) -> str:
    call_id = await session.call("start_process", {"command": command}, idempotency_key=key)
    result = await session.result(call_id)
    assert result["ok"], result
    return call_id


async def test_a_stdin_request_cut_off_by_a_newer_connection_does_not_shift_later_answers(daemon, log_lines):
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
        await until(lambda: not link._lock.locked())  # the link's own first request answered
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
            assert not crashes(log_lines())
        finally:
            with contextlib.suppress(ProcessLookupError):  # ended with its process
                os.kill(holder.holder_pid, signal.SIGCONT)



async def test_a_request_line_cut_short_by_a_cancellation_is_finished_before_the_next_one():
    """A request line the socket does not take at once is written in parts, and the requester
    may be cancelled between them (its control socket superseded while the holder is slow).
    The holder has the line's start: the rest must follow before the next request's line, or
    the two make one garbled line (the first one's stdin never written, the second answered
    with an error), and the cut request's answer must not be taken for the next one's."""
    daemon_end, holder_end = socket.socketpair()
    daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_SEND_BUFFER)
    link = HolderLink(daemon_end)
    holder = trio.socket.from_stdlib_socket(holder_end)
    # A request line as long as a holder takes: far more than the socket's buffer.
    cut = b'{"op":"stdin","pad":"' + b"a" * (MAX_LINE_BYTES - 32) + b'"}\n'
    whole = encode_watch()
    answers: list[Reply] = []
    try:
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.run, lambda _event: None)
                with trio.CancelScope() as first:

                    async def cancel_once_blocked() -> None:
                        await trio.testing.wait_all_tasks_blocked()  # the line is in part written
                        first.cancel()

                    nursery.start_soon(cancel_once_blocked)
                    await link.request(cut)
                assert first.cancelled_caught

                async def second() -> None:
                    answers.append(await link.request(whole))

                nursery.start_soon(second)
                received = bytearray()
                while received.count(b"\n") < 2:
                    with trio.move_on_after(QUIET_S) as quiet:  # the link sent all it will: no line ends
                        received += await holder.recv(65536)
                    assert not quiet.cancelled_caught, f"the lines stopped short: {len(received)} bytes"
                assert bytes(received) == cut + whole
                await holder.send(b'{"n":1,"ok":true}\n{"n":2,"ok":true}\n')
                await until(lambda: bool(answers))
                nursery.cancel_scope.cancel()
        assert answers[0].fields == {"n": 2}  # the second request's answer, not the cut one's
    finally:
        await link.aclose()
        holder.close()


async def test_a_socket_whose_peer_left_while_replies_waited_for_room_is_closed_at_once(daemon, log_lines):
    """A client that sends requests without reading fills the socket, then the reply queue:
    the socket's reader waits for room (back-pressure). When the peer then goes, the sender's
    write fails and the sender stops; the reader must not wait for room that no one will ever
    make, or the socket's task and descriptor stay until a newer connection or the stop (the
    idle timeout cannot end it: its ping fails on the closed WebSocket, and it returns)."""
    client = daemon.client(daemon.unix)
    async with client.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        hub = daemon.supervisor.sessions.hub
        conn = hub.authoritative
        assert conn is not None and conn.sender is not None
        sender = conn.sender
        unknown = "0b7e5d0c-0000-4000-8000-000000000001"
        async with trio.open_nursery() as nursery:

            async def flood() -> None:
                for number in itertools.count():
                    body = {"call_id": unknown, "stream": "stdout", "offset": 0, "length": 1, "request_id": f"r{number}"}
                    await session.send("exec.read_output", body)

            nursery.start_soon(flood)
            # The queue is full and a reply waits for room: the daemon reads no more requests.
            await until(lambda: sender._reply_in.statistics().tasks_waiting_send > 0)
            nursery.cancel_scope.cancel()
        await trio.aclose_forcefully(session.ws._stream)  # the peer goes
        await until(lambda: sender.stopped)  # its write failed
        await until(lambda: conn not in hub.open)
    assert not crashes(log_lines())
    assert any(line.get("event") == "socket.closed" for line in log_lines())  # the log was read


def test_the_journals_memory_serves_no_batch_across_a_gap(tmp_path, monkeypatch):
    """A COMMIT can report an error after it landed (the store then reads its last seq again:
    tests/test_store.py). The journal was told the append failed, so its in-memory window
    lacks those events and the next append leaves a hole in it; the window is read as dense
    by position, so a sender at the hole's start was served the event after it, and the
    landed events were never sent on that socket."""
    from sandbox_supervisor.daemon.state.journal import Journal
    from sandbox_supervisor.daemon.state.store import StateStore, StoreError

    def result(n: int) -> tuple[str, dict]:
        body = {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
                "tool_name": "read_file", "ok": True, "result": {"n": n}}
        return ("tool.result", body)

    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        journal.append([result(1)])
        real = store._idle_connection()

        class CommitLandsThenFails:
            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            def execute(self, sql: str, *args: object) -> object:
                outcome = real.execute(sql, *args)
                if sql == "COMMIT":
                    raise sqlite3.OperationalError("disk I/O error (after the commit landed)")
                return outcome

        monkeypatch.setattr(store, "_idle_connection", lambda: CommitLandsThenFails())
        with pytest.raises(StoreError):
            journal.append([result(2)])
        monkeypatch.undo()
        assert [row.seq for row in journal.append([result(3)])] == [3]
        assert [seq for seq, _ in journal.frames_after(1, 10)] == [2, 3]
        assert journal.frames_after(1, 10) == store.events_after(1, 10)
