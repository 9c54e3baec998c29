"""A call's result written by the task that journaled it (SocketSender.wake(now=True) and
ServerWebSocket.write_now), on a real store and a real loopback WebSocket: only while the
sender is parked with nothing to write, never ahead of a queued reply or of another write,
and a part the socket does not take is written whole, in order, by the sender."""

from __future__ import annotations

import trio
import trio.testing

from sandbox_supervisor.daemon.session.sender import SocketSender
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from tests.ws_support import server_websocket_pair

FRAME_TIMEOUT_S = 10.0


def tool_result(n: int) -> dict:
    return {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
            "tool_name": "read_file", "ok": True, "result": {"n": n}}


async def with_parked_sender(tmp_path, body, **sender_options) -> None:
    """A journal on a real store and its sender on a real socket pair, the sender parked
    (waiting, nothing to write) when `body(journal, sender, ws, recorded stream, client)`
    starts."""
    store = StateStore.open(tmp_path / "state")
    journal = Journal(store)
    try:
        async with server_websocket_pair() as (ws, counted, client):
            with trio.fail_after(FRAME_TIMEOUT_S):
                sender = SocketSender(ws, journal, cursor=0, **sender_options)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sender.run)
                    await trio.testing.wait_all_tasks_blocked()
                    await body(journal, sender, ws, counted, client)
                    nursery.cancel_scope.cancel()
    finally:
        store.close()


async def test_a_result_journaled_while_the_sender_is_parked_is_written_before_the_journaling_task_yields(tmp_path):
    async def body(journal, sender, ws, counted, client):
        rows = journal.complete_call(None, tool_result(1))
        # No checkpoint since the commit: the write was made from this task.
        assert len(counted.writes) == 1 and b'"n":1' in bytes(counted.data)
        assert sender.cursor == rows[-1].seq and sender.sent_through(rows[-1].seq)
        assert '"seq":1' in await client.get_message()

        # Other events (a command's output) still wake the sender, which batches what one
        # wake-up finds: nothing is written until this task yields.
        journal.append([("tool.result", tool_result(2))])
        assert len(counted.writes) == 1
        assert '"seq":2' in await client.get_message()
        assert len(counted.writes) == 2

    await with_parked_sender(tmp_path, body)


async def test_a_result_behind_a_queued_reply_is_left_to_the_sender_and_follows_the_reply(tmp_path):
    async def body(journal, sender, ws, counted, client):
        await sender.reply('{"kind":"exec.stdin_ack"}')  # queued, the sender woken, not yet run
        journal.complete_call(None, tool_result(1))
        assert counted.writes == []
        received = [await client.get_message() for _ in range(2)]
        assert received[0] == '{"kind":"exec.stdin_ack"}' and '"seq":1' in received[1]
        assert len(counted.writes) == 1  # together, in the sender's one write

    await with_parked_sender(tmp_path, body)


async def hold_the_write_lock(ws, until: trio.Event, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Another writer (a pong, say) holding the socket's write lock until `until` is set."""
    async with ws._write_lock:
        task_status.started()
        await until.wait()


async def test_a_result_while_another_write_holds_the_lock_waits_for_it(tmp_path):
    async def body(journal, sender, ws, counted, client):
        release = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(hold_the_write_lock, ws, release)
            rows = journal.complete_call(None, tool_result(1))
            assert counted.writes == [] and not sender.sent_through(rows[-1].seq)
            await trio.testing.wait_all_tasks_blocked()
            assert counted.writes == []  # the sender waits for the lock too
            release.set()
        assert '"seq":1' in await client.get_message()

    await with_parked_sender(tmp_path, body)


async def test_the_part_of_a_result_the_socket_did_not_take_is_written_whole_and_in_order(tmp_path):
    """The socket takes only the first bytes of the written-through frame (as a nearly full
    socket would): the rest is carried, the sender writes it before anything else, and the
    client reads every frame whole, in seq order. Until then the event is not sent."""

    async def body(journal, sender, ws, counted, client):
        real_write_now = counted.write_now
        taken: list[int] = []

        def takes_seven_bytes(data: bytes) -> int | None:
            written = real_write_now(data[:7])  # the real socket, seven bytes of the frame
            taken.append(written)
            return written

        counted.write_now = takes_seven_bytes
        first = journal.complete_call(None, tool_result(1))
        assert taken == [7] and ws.carrying
        assert sender.cursor == first[-1].seq and not sender.sent_through(first[-1].seq)
        # A second result while the carry waits is not written through (it would split the
        # first frame): the sender writes the carry, then it.
        second = journal.complete_call(None, tool_result(2))
        assert taken == [7]
        received = [await client.get_message() for _ in range(2)]
        assert ['"seq":1' in received[0], '"seq":2' in received[1]] == [True, True]
        await sender.flush(second[-1].seq)
        assert not ws.carrying and sender.sent_through(second[-1].seq)

    await with_parked_sender(tmp_path, body)


async def test_a_write_waiting_for_a_held_lock_still_ends_at_the_write_timeout(tmp_path, autojump_clock):
    """The write deadline is set when a write first waits, for room in the socket or, as
    here, for the write lock (another writer stuck on a peer that stopped reading)."""
    timeout_s = 1.0
    stalled = trio.Event()

    async def body(journal, sender, ws, counted, client):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold_the_write_lock, ws, trio.Event())  # never released
            started = trio.current_time()
            journal.complete_call(None, tool_result(1))  # not written through: the lock is held
            await stalled.wait()
            assert sender.stalled and trio.current_time() - started >= timeout_s
            nursery.cancel_scope.cancel()

    await with_parked_sender(tmp_path, body, write_timeout_s=timeout_s, on_stalled=stalled.set)



async def test_a_failed_read_for_the_write_through_is_not_the_commits_failure(tmp_path):
    """The events are read for the write from memory, or else from the store; when that
    read fails, the commit that woke the sender still returns its rows (its caller would
    otherwise take its result for unjournaled), and the sender's own pass sends them."""
    from sandbox_supervisor.daemon.state.store import StoreError

    async def body(journal, sender, ws, counted, client):
        real = journal.frames_after
        failures = []

        def fails_once(*args, **kwargs):
            if not failures:
                failures.append(args)
                raise StoreError("disk I/O error")
            return real(*args, **kwargs)

        journal.frames_after = fails_once
        rows = journal.complete_call(None, tool_result(1))
        assert failures and rows[-1].seq == 1 and counted.writes == []
        assert '"seq":1' in await client.get_message()

    await with_parked_sender(tmp_path, body)


class _Full:
    """Makes the recorded stream's socket look full (what `write_now` and `wait_writable`
    see) until `room()`; the bytes still go to the real socket once there is room."""

    def __init__(self, counted) -> None:
        self.counted = counted
        self.real_write_now = counted.write_now
        self.real_wait = counted.wait_writable
        self.has_room = trio.Event()
        counted.write_now = lambda data: 0
        counted.wait_writable = self.has_room.wait

    def room(self) -> None:
        self.counted.write_now = self.real_write_now
        self.counted.wait_writable = self.real_wait
        self.has_room.set()


def first_write_takes_seven_bytes(counted) -> None:
    real = counted.write_now

    def takes_seven(data: bytes) -> int | None:
        counted.write_now = real
        return real(data[:7])

    counted.write_now = takes_seven


async def test_a_carry_another_write_is_writing_is_still_unsent_and_flush_waits_for_its_end(tmp_path):
    """A pong or a ping that takes the lock writes the carry first; until its last byte is
    written the event is not sent (`sent_through`, the drain's `flush`), and once it is, a
    waiting flush returns."""
    from wsproto.events import Ping

    async def body(journal, sender, ws, counted, client):
        first_write_takes_seven_bytes(counted)
        rows = journal.complete_call(None, tool_result(1))
        assert ws.carrying
        full = _Full(counted)
        flushed = trio.Event()

        async def flush() -> None:
            await sender.flush(rows[-1].seq)
            flushed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws._send_control, Ping(payload=b"abcd"))
            nursery.start_soon(flush)
            await trio.testing.wait_all_tasks_blocked()
            assert ws.carrying and not sender.sent_through(rows[-1].seq) and not flushed.is_set()
            full.room()
        assert flushed.is_set() and not ws.carrying
        assert '"seq":1' in await client.get_message()  # whole (the client answers the ping)

    await with_parked_sender(tmp_path, body)


async def test_a_write_cut_short_in_the_carry_leaves_the_rest_and_the_frames_stay_whole(tmp_path):
    """A ping bounded by its caller's timeout, cut short while the socket is full, leaves
    what it did not write in the carry: the next write finishes the frame before anything
    else, and the client reads every frame whole."""
    from wsproto.events import Ping

    async def body(journal, sender, ws, counted, client):
        first_write_takes_seven_bytes(counted)
        journal.complete_call(None, tool_result(1))
        full = _Full(counted)
        with trio.move_on_after(0.2) as cut:
            await ws._send_control(Ping(payload=b"abcd"))
        assert cut.cancelled_caught and ws.carrying
        journal.append([("tool.result", tool_result(2))])
        full.room()
        received = [await client.get_message() for _ in range(2)]
        assert ['"seq":1' in received[0], '"seq":2' in received[1]] == [True, True]

    await with_parked_sender(tmp_path, body)


async def test_a_reply_sent_with_the_carry_wakes_a_waiting_flush(tmp_path):
    """The carry goes out in a pass that has a reply and no new event: the waiting flush
    still learns that the event is now sent."""

    async def body(journal, sender, ws, counted, client):
        first_write_takes_seven_bytes(counted)
        rows = journal.complete_call(None, tool_result(1))
        await sender.reply('{"kind":"x"}')  # queued before the sender's task runs
        with trio.fail_after(2):
            await sender.flush(rows[-1].seq)
        received = [await client.get_message() for _ in range(2)]
        assert '"seq":1' in received[0] and received[1] == '{"kind":"x"}'

    await with_parked_sender(tmp_path, body)


async def test_a_reply_that_waited_for_room_still_goes_before_later_events(tmp_path):
    """A reply that waited for room in a full queue is moved into it by the sender's own
    receive, before its task resumes: it counts as queued from then, so an event journaled
    after it does not overtake it in a pass that stops at a write's worth of replies."""
    from sandbox_supervisor.daemon.session.sender import REPLY_QUEUE_SIZE

    def reply_of(i: int, size: int = 4096) -> str:
        head = '{"r":%d,"p":"' % i
        return head + "x" * (size - len(head) - 2) + '"}'

    async def body(journal, sender, ws, counted, client):
        release = trio.Event()
        got = []
        async with trio.open_nursery() as nursery:
            await nursery.start(hold_the_write_lock, ws, release)
            await sender.reply('{"r":0}')
            await trio.testing.wait_all_tasks_blocked()  # the sender took it, and waits for the lock
            for i in range(1, REPLY_QUEUE_SIZE + 1):  # a full queue, a write's worth of bytes
                await sender.reply(reply_of(i))
            nursery.start_soon(sender.reply, '{"r":"last"}')  # waits for room
            await trio.testing.wait_all_tasks_blocked()
            journal.append([("tool.result", tool_result(1))])  # journaled after that reply
            release.set()
            for _ in range(REPLY_QUEUE_SIZE + 3):
                message = await client.get_message()
                got.append("event" if '"seq"' in message else message[:12])
        assert got[-2:] == ['{"r":"last"}', "event"]

    await with_parked_sender(tmp_path, body)


async def test_a_ping_cut_short_after_part_of_its_frame_is_finished_by_the_next_write(monkeypatch):
    """The keepalive bounds its ping; cut short once the socket took part of the ping's frame,
    the rest stays in the carry and the next write finishes it first: the client reads the
    next message, not a torn frame (before: 1002, the next frame's bytes read as the ping's)."""
    import os
    import types

    from wsproto.events import Ping

    import sandbox_supervisor.daemon.websocket as wsmod

    async with server_websocket_pair() as (ws, counted, client):
        fd = ws._io._socket.fileno()
        full = {"now": False}
        room = trio.Event()
        real_write, real_fd_wait = os.write, wsmod.fd_wait

        def write(target: int, data) -> int:
            if target == fd:
                if full["now"]:
                    raise BlockingIOError(11, "full")
                if len(data) and data[0] == 0x89:  # the ping: the socket takes 3 of its bytes
                    full["now"] = True
                    return real_write(target, bytes(data[:3]))
            return real_write(target, data)

        class FdWait:
            wait_readable = staticmethod(real_fd_wait.wait_readable)

            @staticmethod
            async def wait_writable(sock) -> None:
                if sock.fileno() == fd and full["now"]:
                    await room.wait()
                else:
                    await real_fd_wait.wait_writable(sock)

        monkeypatch.setattr(wsmod, "os", types.SimpleNamespace(write=write, read=os.read, urandom=os.urandom))
        monkeypatch.setattr(wsmod, "fd_wait", FdWait())
        with trio.move_on_after(0.2) as cut:
            await ws._send_control(Ping(payload=b"abcd"))
        assert cut.cancelled_caught and ws.carrying and not ws._write_lock.locked()
        full["now"] = False
        room.set()
        with trio.fail_after(FRAME_TIMEOUT_S):
            await ws.send_message("after the ping")
            assert await client.get_message() == "after the ping"
