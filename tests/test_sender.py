"""The socket sender's writes: frames that are ready together share one socket write, and
arrive as the same messages, in the same order, as one `send_message` each would give."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
import trio_websocket
import wsproto.frame_protocol

from sandbox_supervisor.daemon.websocket import LARGE_MESSAGE_BYTES, WRITE_BATCH_MAX_BYTES, ConnectionClosed, ServerWebSocket, StreamIO
from sandbox_supervisor.daemon.session.sender import SocketSender
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from tests.ws_support import RecordingIO, server_websocket_pair

FRAME_TIMEOUT_S = 10.0


def tool_result(n: int) -> dict:
    return {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
            "tool_name": "read_file", "ok": True, "result": {"n": n}}


async def with_pair(body: Callable[[ServerWebSocket, RecordingIO, trio_websocket.WebSocketConnection], object]) -> None:
    """A real WebSocket over loopback TCP; `body(server_ws, its recorded stream, client_ws)`."""
    async with server_websocket_pair() as (ws, counted, client):
        with trio.fail_after(FRAME_TIMEOUT_S):
            await body(ws, counted, client)


def counted_writes(counted: RecordingIO) -> list[int]:
    return [len(data) for data in counted.writes]


async def test_frames_ready_together_are_one_write_and_arrive_intact():
    texts = ["first", '{"kind":"x","text":"é ✓ 😀"}', "third" * 100]

    async def body(ws, counted, client):
        await ws.send_messages(texts)
        assert counted.writes and len(counted.writes) == 1
        assert [await client.get_message() for _ in texts] == texts
        # Byte for byte what one send_message per frame writes, and what wsproto frames.
        batched = bytes(counted.data)
        counted.data.clear()
        for text in texts:
            await ws.send_message(text)
        assert bytes(counted.data) == batched
        framer = wsproto.frame_protocol.FrameProtocol(client=False, extensions=[])
        assert batched == b"".join(bytes(framer.send_data(text, True)) for text in texts)
        assert [await client.get_message() for _ in texts] == texts

    await with_pair(body)


async def test_a_burst_larger_than_a_write_is_split_and_stays_in_order():
    # Sixteen frames of an eighth of a write each (each below LARGE_MESSAGE_BYTES, so
    # batched): two writes, never one frame split across messages.
    size = WRITE_BATCH_MAX_BYTES // 8
    assert size < LARGE_MESSAGE_BYTES
    texts = [chr(ord("a") + i) * size for i in range(16)]

    async def body(ws, counted, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.send_messages, texts)
            received = [await client.get_message() for _ in texts]
        assert received == texts
        assert len(counted.writes) == 2, counted_writes(counted)

    await with_pair(body)


async def test_a_reply_and_the_events_after_it_go_out_in_one_write(tmp_path):
    """An acknowledgement and the journaled events that are ready with it (a keystroke's
    exec.stdin_ack and its echo): one socket write, the reply first, then the events by seq."""
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)

    async def body(ws, counted, client):
        sender = SocketSender(ws, journal, cursor=0)
        await sender.reply('{"kind":"exec.stdin_ack"}')
        journal.append([("tool.result", tool_result(1)), ("tool.result", tool_result(2))])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            received = [await client.get_message() for _ in range(3)]
            await sender.flush(2)
            nursery.cancel_scope.cancel()
        assert received[0] == '{"kind":"exec.stdin_ack"}'
        assert ['"seq":1' in received[1], '"seq":2' in received[2]] == [True, True]
        assert len(counted.writes) == 1, counted_writes(counted)

    try:
        await with_pair(body)
    finally:
        store.close()


CALL_ID = "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21"


def exec_started(pid: int = 4242) -> dict:
    return {"call_id": CALL_ID, "pid": pid, "pgid": pid, "command": "true", "cwd": "/", "started_at": 1.7e9,
            "context": {"session_id": "s-1", "generation": 1, "idempotency_key": None}}


def exec_completed() -> dict:
    summary = {"bytes": 0, "head": "", "tail": "", "truncated": False}
    return {"call_id": CALL_ID, "exit_code": 0, "signal": None, "timed_out": False, "duration_ms": 1,
            "stdout": summary, "stderr": summary, "interrupted": False}


async def with_held_sends(tmp_path, body, *, waker: bool = True) -> None:
    """A journal on a real store, its sender on a real socket pair, both idle when
    `body(journal, its recorded stream, client_ws)` starts; with `waker`, the journal's
    `wake_held` task runs (as in the daemon)."""
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)

    async def run(ws, counted, client):
        async with trio.open_nursery() as nursery:
            if waker:
                nursery.start_soon(journal.wake_held)
            nursery.start_soon(SocketSender(ws, journal, cursor=0).run)
            await trio.testing.wait_all_tasks_blocked()
            await body(journal, counted, client)
            nursery.cancel_scope.cancel()

    try:
        await with_pair(run)
    finally:
        store.close()


async def test_a_held_exec_started_goes_out_with_the_commands_next_events_in_one_write(tmp_path):
    """A command's exec.started is committed at once but its send waits for what follows
    (its exec.completed and result): one write for the three, nothing written before."""

    async def body(journal, counted, client):
        rows = journal.start_process(CALL_ID, 4242, 4242, 1, exec_started(), hold_s=60.0)
        assert journal.last_seq == rows[-1].seq == 1  # committed, only not sent
        await trio.testing.wait_all_tasks_blocked()
        assert counted.writes == []
        journal.complete_call(None, tool_result(1), preceding=[("exec.completed", exec_completed())])
        received = [await client.get_message() for _ in range(3)]
        assert ['"exec.started"' in received[0], '"exec.completed"' in received[1], '"tool.result"' in received[2]] == [True] * 3
        assert len(counted.writes) == 1, counted_writes(counted)

    await with_held_sends(tmp_path, body)


async def test_a_held_event_that_nothing_follows_is_sent_once_its_hold_is_over(tmp_path):
    async def body(journal, counted, client):
        held_at = trio.current_time()
        journal.start_process(CALL_ID, 4242, 4242, 1, exec_started(), hold_s=0.2)
        # A second hold does not push the first one's send back.
        journal.start_process("1c7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", 4343, 4343, 1, exec_started(4343), hold_s=60.0)
        await trio.testing.wait_all_tasks_blocked()
        assert counted.writes == []
        received = [await client.get_message() for _ in range(2)]
        assert 0.2 <= trio.current_time() - held_at < 60.0
        assert ['"seq":1' in received[0], '"seq":2' in received[1]] == [True, True]
        assert len(counted.writes) == 1, counted_writes(counted)

    await with_held_sends(tmp_path, body)


async def test_nothing_is_held_while_the_journal_has_no_task_to_end_holds(tmp_path):
    # Without `wake_held` (a journal used outside the daemon, or after its stop), a hold
    # would be a send that may never come: the senders are woken at once instead.
    async def body(journal, counted, client):
        journal.start_process(CALL_ID, 4242, 4242, 1, exec_started(), hold_s=60.0)
        assert '"exec.started"' in await client.get_message()

    await with_held_sends(tmp_path, body, waker=False)


async def test_a_hold_taken_as_the_holds_task_is_being_cancelled_is_sent_at_once(tmp_path):
    """The stop cancels `wake_held`; a hold taken after the cancellation but before the
    task has run again (its scope still in place) has nobody left to end it: the task's
    exit ends it, so the event is not left waiting for the next append or a replay."""
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)

    async def body(ws, counted, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(SocketSender(ws, journal, cursor=0).run)
            async with trio.open_nursery() as holds:
                holds.start_soon(journal.wake_held)
                await trio.testing.wait_all_tasks_blocked()
                holds.cancel_scope.cancel()
                journal.start_process(CALL_ID, 4242, 4242, 1, exec_started(), hold_s=60.0)
            assert '"exec.started"' in await client.get_message()
            nursery.cancel_scope.cancel()

    try:
        await with_pair(body)
    finally:
        store.close()


async def test_a_close_from_the_peer_between_two_writes_of_a_batch_is_connection_closed():
    # Review finding: the batch's first write is under way when the peer's Close arrives;
    # the next message must end the batch with ConnectionClosed (what the sender handles),
    # never a data frame after the close, nor an error of another kind (a crash of the socket).
    texts = ["x" * WRITE_BATCH_MAX_BYTES, "second"]

    async def body(ws, counted, client):
        passed_on = counted.send_all

        async with trio.open_nursery() as nursery:

            async def read_the_close() -> None:
                # The socket's reader task reads the peer's Close and answers it (once the
                # write lets go of the stream).
                with pytest.raises(ConnectionClosed):
                    await ws.get_message()

            async def first_write_then_wait_for_the_close(data: bytes, before_wait=None) -> None:
                await passed_on(data, before_wait)
                nursery.start_soon(client.aclose)
                nursery.start_soon(read_the_close)
                while ws._close_reason is None:  # the server side has read the peer's Close
                    await trio.sleep(0.005)

            counted.send_all = first_write_then_wait_for_the_close  # type: ignore[method-assign]
            try:
                await ws.send_messages(texts)
            except ConnectionClosed:
                pass
            else:
                raise AssertionError("a batch after the peer's Close ended without ConnectionClosed")
            counted.send_all = passed_on  # type: ignore[method-assign]
        # Nothing after the first message's frame was written: no data frame after a close.
        assert len(counted.writes) == 3, counted_writes(counted)  # header, payload, the close's answer
        assert bytes(counted.writes[2])[0] == 0x88  # a close frame

    await with_pair(body)


class _FullQueueSocket:
    """A WebSocket that never completes a write: the reply queue fills and stays full."""

    carrying = False

    async def send_messages(self, texts: object, **_: object) -> None:
        await trio.sleep_forever()


class _NoJournal:
    last_seq = 0
    pruned_through = 0

    def subscribe(self, wake) -> None: ...

    def unsubscribe(self, wake) -> None: ...


async def test_a_reply_cancelled_while_the_queue_is_full_gives_its_size_back():
    # Review finding: the queue's size count grew before the wait for room and was never
    # given back when that wait was cancelled, so the cap shrank for good.
    from sandbox_supervisor.daemon.session.sender import REPLY_QUEUE_SIZE

    sender = SocketSender(_FullQueueSocket(), _NoJournal(), 0)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)
        await trio.testing.wait_all_tasks_blocked()
        await sender.reply("r")  # taken by the sender, whose write never completes
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(REPLY_QUEUE_SIZE):  # the queue full by count
            await sender.reply("r")
        before = sender._queued_chars
        with trio.move_on_after(0.05) as scope:
            await sender.reply("y" * 1000)  # no room by count: waits, then is cancelled
        assert scope.cancelled_caught
        assert sender._queued_chars == before
        nursery.cancel_scope.cancel()


async def test_an_idle_sender_outlives_its_write_timeout_and_a_stalled_write_ends_it(tmp_path, autojump_clock):
    """The write deadline runs only while a write is under way: a socket idle for many write
    timeouts between two writes keeps its sender; a write the peer never takes ends it,
    stalled, after the timeout."""
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)
    timeout_s = 1.0

    async def body(ws, counted, client):
        stalled = trio.Event()
        sender = SocketSender(ws, journal, cursor=0, write_timeout_s=timeout_s, on_stalled=stalled.set)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            await sender.reply("one")
            assert await client.get_message() == "one"
            await trio.sleep(5 * timeout_s)  # idle (the mock clock jumps)
            await sender.reply("two")
            assert await client.get_message() == "two"
            assert not sender.stopped and not sender.stalled
            # Now a write that never completes: the peer has stopped reading.
            never = trio.Event()

            async def blocked_write(data: bytes, before_wait=None) -> None:
                # A socket that stays full: the write waits (and says so first, as
                # StreamIO.send_all does, which is when the write deadline is set).
                if before_wait is not None:
                    before_wait()
                await never.wait()

            counted.send_all = blocked_write  # type: ignore[method-assign]
            started = trio.current_time()
            await sender.reply("three")
            await stalled.wait()
            assert sender.stalled and sender.stopped
            assert trio.current_time() - started >= timeout_s
            nursery.cancel_scope.cancel()

    try:
        await with_pair(body)
    finally:
        store.close()


async def test_a_write_takes_a_free_stream_lock_without_yielding_and_waits_for_a_held_one():
    """A free stream lock costs no pass of the event loop before the write (the task's step
    goes on until the write itself yields); a lock the reader task holds (a pong, the close)
    is waited for, and the write follows once it is released."""

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.ended: list[trio.lowlevel.Task] = []

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            self.ended.append(task)

    class WatchedStream(RecordingIO):
        steps_before_write: list[int] = []

        async def send_all(self, data: bytes | bytearray | memoryview, before_wait=None) -> None:
            self.steps_before_write.append(steps.ended.count(trio.lowlevel.current_task()))
            await super().send_all(data, before_wait)

    steps = Steps()

    async def body(ws, counted, client):
        watched = WatchedStream(counted.stream)
        ws._io = watched
        trio.lowlevel.add_instrument(steps)
        try:
            steps.ended.clear()
            await ws.send_messages(["echo"])
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert watched.steps_before_write == [0]  # no yield between the call and the write
        assert await client.get_message() == "echo"

        # Held by another task: the write waits for its release, then goes out whole.
        released = trio.Event()

        async def hold_then_release(task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with ws._write_lock:
                task_status.started()
                await trio.testing.wait_all_tasks_blocked()  # the write below waits on it
                released.set()

        async with trio.open_nursery() as nursery:
            await nursery.start(hold_then_release)
            await ws.send_messages(["after", "the lock"])
            assert released.is_set()
        assert [await client.get_message() for _ in range(2)] == ["after", "the lock"]

    await with_pair(body)


class NoYieldStream:
    """A socket stream whose writes are taken at once, without a checkpoint: as the edge's
    direct write (StreamIO) when the socket has room."""

    def __init__(self) -> None:
        self.writes = 0
        self.first = trio.Event()

    async def send_all(self, data: bytes, before_wait=None) -> None:
        self.writes += 1
        self.first.set()


async def test_writes_that_do_not_yield_still_let_other_tasks_run_between_them(tmp_path):
    """The edge's socket writes do not yield when the socket takes everything at once; a
    sender with several batches to write (a replay) still gives way between its writes, so
    no other task of the daemon waits for the whole burst."""
    from sandbox_supervisor.daemon.session.sender import EVENT_BATCH

    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)
    journal.append([("tool.result", tool_result(n)) for n in range(3 * EVENT_BATCH)])

    async def body(ws, counted, client):
        stream = NoYieldStream()
        ws._io = stream
        sender = SocketSender(ws, journal, cursor=0)
        seen: list[int] = []

        async def watch() -> None:
            while sender.cursor < journal.last_seq:
                seen.append(stream.writes)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            nursery.start_soon(watch)
            await sender.flush(journal.last_seq)
            nursery.cancel_scope.cancel()
        ws._io = counted  # the real stream again, for the close
        assert stream.writes == 3
        assert any(0 < writes < 3 for writes in seen), seen  # it ran between the writes

    try:
        await with_pair(body)
    finally:
        store.close()


async def test_a_sender_kept_busy_by_writes_that_do_not_yield_stops_when_cancelled(tmp_path):
    """The pass of the event loop between such writes is also where the connection's end
    reaches the sender: cancelled after its first write, it stops there, instead of writing
    the whole backlog first (a superseded socket under a long replay)."""
    from sandbox_supervisor.daemon.session.sender import EVENT_BATCH

    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)
    journal.append([("tool.result", tool_result(n)) for n in range(8 * EVENT_BATCH)])

    async def body(ws, counted, client):
        stream = NoYieldStream()
        ws._io = stream
        sender = SocketSender(ws, journal, cursor=0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            await stream.first.wait()
            nursery.cancel_scope.cancel()
        ws._io = counted  # the real stream again, for the close
        assert sender.stopped
        assert stream.writes < 8, stream.writes  # not the whole backlog

    try:
        await with_pair(body)
    finally:
        store.close()


async def test_the_edge_writes_a_socket_directly_and_waits_only_while_it_is_full():
    """StreamIO writes a socket without trio's pass of the event loop after a write the
    socket took at once; a full socket is waited on and every byte arrives in order; a closed
    stream and a broken connection fail as trio's own send_all does."""
    import socket as stdlib_socket
    import struct

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.ended: list[trio.lowlevel.Task] = []

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            self.ended.append(task)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    replay = StreamIO(server)
    try:
        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            await replay.send_all(b"small")
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert trio.lowlevel.current_task() not in steps.ended  # no yield: the socket took it
        assert await client.receive_some(5) == b"small"

        big = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the socket holds
        received = bytearray()

        async def read_all() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the writer waits on a full socket
            while len(received) < len(big):
                received.extend(await client.receive_some(1 << 20))

        with trio.fail_after(FRAME_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                await replay.send_all(big)
        assert bytes(received) == big

        # The peer resets the connection: BrokenResourceError (at the latest on a later write).
        client.socket.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()
        with trio.fail_after(FRAME_TIMEOUT_S), pytest.raises(trio.BrokenResourceError):
            while True:
                await replay.send_all(b"x" * 65536)
                await trio.lowlevel.checkpoint()
    finally:
        await replay.aclose()
        for listener in listeners:
            await listener.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await replay.send_all(b"after the close")


async def test_the_edge_reads_a_socket_once_it_is_readable_and_fails_as_trio_does():
    """StreamIO's direct read (it waits for readability before reading): what the peer
    sent, in order; b"" at the end of the stream; BrokenResourceError on a reset connection
    and ClosedResourceError once the stream is closed, as trio's own receive_some."""
    import socket as stdlib_socket
    import struct

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    try:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        replay = StreamIO(await listeners[0].accept())

        async def send_later() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for it
            await client.send_all(b"typed")

        with trio.fail_after(FRAME_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_later)
                assert await replay.receive_some() == b"typed"
            await client.send_all(b"abcdef")
            assert await replay.receive_some(4) == b"abcd"
            assert await replay.receive_some(4) == b"ef"
            await client.send_eof()
            assert await replay.receive_some() == b""
        await client.aclose()
        await replay.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await replay.receive_some()

        client = await trio.open_tcp_stream("127.0.0.1", port)
        replay = StreamIO(await listeners[0].accept())
        client.socket.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()  # a reset
        with trio.fail_after(FRAME_TIMEOUT_S), pytest.raises(trio.BrokenResourceError):
            await replay.receive_some()
        await replay.aclose()
    finally:
        for listener in listeners:
            await listener.aclose()
