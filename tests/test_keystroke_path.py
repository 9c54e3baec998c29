"""The way of one keystroke through a held process's terminal (bench/README.md, "Issue 10: the
stdin round trip"): each test pins one property the round trip relies on, with real sockets,
a real sqlite journal and real spool files.

- The holder sends a reply or an output event in the loop turn that made it, not on a later
  turn once its selector reports the socket writable.
- The daemon journals a running process's output as the holder's event arrives, in the link's
  reader, without handing it to the pump task first.
- When a reply and events come in one read, what the events wake (the socket's sender) runs
  before the requester resumes: the echo does not wait for the exec.stdin_ack.
"""

from __future__ import annotations

import json
import selectors
import socket
from pathlib import Path

import trio

from sandbox_supervisor.daemon.runtime.command_output import OutputLimits
from sandbox_supervisor.daemon.runtime.held import HeldProcess, HolderLink
from sandbox_supervisor.daemon.runtime.holder import Client, Holder
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    HolderSpec,
    Message,
    OutputEvent,
    Reply,
    TerminalSize,
    decode_message,
    encode_watch,
    event_output,
    reply_ok,
)
from sandbox_supervisor.daemon.runtime.process_host import ProcessHost
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import HeldRecord, StateStore

WAIT_S = 10.0  # deadline for anything a test waits for (2 shared cores)
CALL_ID = "6f1c2a57-3f7e-4a43-9f55-0b6f4d2c1e90"
ECHO = b"x\r\nx\r\n"  # the terminal's echo of "x\n" and cat's copy
# Rounds of the ordering test: handed over in one batch, each round would pass with
# probability 1/2 (trio runs a batch in either order), so all of them with 2**-ROUNDS.
ROUNDS = 20


def _lines(sock: socket.socket) -> list[Message]:
    """What the holder has sent so far, without waiting: BlockingIOError when nothing."""
    return [decode_message(line) for line in sock.recv(65536).splitlines()]


def test_the_holder_sends_a_reply_and_an_output_event_in_the_turn_that_made_them(tmp_path: Path) -> None:
    # A terminal's spec: one stream (the holder is not started, so no terminal is opened).
    spec = HolderSpec(argv=("cat",), cwd="/", env={}, pty=TerminalSize(24, 80), kill_grace_s=1.0)
    holder = Holder(tmp_path / CALL_ID, spec)
    daemon_end, holder_end = socket.socketpair()
    daemon_end.setblocking(False)
    try:
        holder.client = Client(holder_end)
        holder._client_interest()
        daemon_end.sendall(encode_watch())
        holder._on_client(selectors.EVENT_READ)  # one turn: the request read and answered
        assert _lines(daemon_end) == [Reply(ok=True, fields={})]
        holder.writers["stdout"].write(ECHO)  # what a read of the terminal spools
        holder._queue_events()  # the end of the same turn
        assert _lines(daemon_end) == [OutputEvent(stream="stdout", total=len(ECHO), kept=len(ECHO))]
    finally:
        for writer in holder.writers.values():
            writer.close()
        holder._drop_client()
        holder.selector.close()
        holder.listener.close()
        daemon_end.close()


async def test_a_running_process_output_is_journaled_as_its_event_arrives(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)
    record = HeldRecord(
        call_id=CALL_ID,
        tool_name="start_process",
        command="cat",
        pty=True,
        pid=1,
        pgid=1,
        start_ticks=1,
        holder_pid=1,
        holder_start_ticks=1,
        started_at=0.0,
        origin=None,
        context_json=json.dumps({"session_id": "s", "generation": 1, "idempotency_key": "k"}),
    )
    started = {"call_id": CALL_ID, "pid": 1, "pgid": 1, "command": "cat", "cwd": "/", "started_at": 0.0}
    journal.start_held(record, {**started, "context": json.loads(record.context_json)})
    directory = tmp_path / "spool" / CALL_ID
    directory.mkdir(parents=True)
    (directory / "stdout").write_bytes(ECHO)
    limits = OutputLimits(throttle_ms=50.0, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1 << 20)
    process = HeldProcess(record, directory, limits)
    # Only the journal is used on this path; the rest of a host (shell, nursery…) is not.
    host = ProcessHost.__new__(ProcessHost)
    host.journal = journal
    try:
        before = journal.last_seq
        host._on_event(process, OutputEvent(stream="stdout", total=len(ECHO), kept=len(ECHO)))
        frames = [json.loads(row.frame) for row in journal.rows_after(before, 10)]
        assert [(frame["kind"], frame["body"]["text"]) for frame in frames] == [("exec.output", ECHO.decode())]
        assert not process.wake.is_set()  # nothing left for the pump to do
        assert store.held_record(CALL_ID).sent["stdout"] == len(ECHO)  # type: ignore[union-attr]
    finally:
        process.close_files()
        store.close()


async def test_what_the_events_that_came_with_a_reply_wake_runs_before_the_requester() -> None:
    """The echo is not kept waiting for the acknowledgement: the socket's sender, woken as
    the events are journaled, runs before the requester resumes with the holder's reply."""
    daemon_end, holder_end = socket.socketpair()
    link = HolderLink(daemon_end)
    holder = trio.SocketStream(trio.socket.from_stdlib_socket(holder_end))
    answered = False
    woken = trio.Event()
    seen_answered: list[bool] = []

    def on_event(_event: Message) -> None:
        woken.set()  # as the journal wakes the socket's sender

    async def sender() -> None:
        nonlocal woken
        for _ in range(ROUNDS):
            await woken.wait()
            woken = trio.Event()
            seen_answered.append(answered)

    async def requester() -> None:
        nonlocal answered
        for round_ in range(ROUNDS):
            answered = False
            await link.request(encode_watch())
            answered = True  # the daemon would now queue exec.stdin_ack
            while len(seen_answered) <= round_:  # the sender has run for this round
                await trio.sleep(0.001)

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run, on_event)
            nursery.start_soon(sender)
            nursery.start_soon(requester)
            for _ in range(ROUNDS):
                await holder.receive_some(65536)  # the request
                await holder.send_all(reply_ok() + event_output("stdout", len(ECHO), len(ECHO)))
            while len(seen_answered) < ROUNDS:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    assert seen_answered == [False] * ROUNDS
