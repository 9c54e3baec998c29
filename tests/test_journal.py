"""The event journal over real sockets: dense seqs, acks, pruning, replay (docs/protocol.md §9)."""

from __future__ import annotations


import trio

from sandbox_supervisor.testing.daemon import in_process_daemon


def tool_result(**result: object) -> dict:
    """A valid tool.result body (the journal validates every event) carrying `result`."""
    return {"call_id": "0b7c2f9e-52a4-4a0e-9d55-3f0a4f3f8e21", "idempotency_key": None,
            "tool_name": "read_file", "ok": True, "result": result}


async def make_events(session, count: int, path: str = "note.txt") -> list[str]:
    """Produce `count` journaled events (read_file results) and wait for them all."""
    call_ids = [await session.call("read_file", {"path": path}) for _ in range(count)]
    for call_id in call_ids:
        await session.result(call_id)
    return call_ids


def seqs_of(frames):
    return [f["seq"] for f in frames]


async def collect_replay(session, expected_last: int) -> list[dict]:
    frames = []
    while not frames or frames[-1]["seq"] < expected_last:
        frame = await session.receive()
        if "seq" in frame:
            frames.append(frame)
    return frames


async def test_seqs_are_dense_and_ordered_across_reconnects_and_restarts(layout):
    (layout.workspace / "note.txt").write_text("hello\n")
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await make_events(session, 5)
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await make_events(session, 3)
    async with in_process_daemon(layout) as daemon:
        client.endpoint = daemon.tcp
        async with client.connect() as session:
            state = await session.bootstrap(cwd=str(layout.workspace))
            assert state["body"]["localEventMax"] == 8
            await make_events(session, 4)
        # A fresh client with floor 0 gets the whole journal, in order, once.
        fresh = daemon.client()
        fresh.state.generation = client.state.generation
        async with fresh.connect(ack_floor=0) as session:
            await session.bootstrap(cwd=str(layout.workspace))
            frames = await collect_replay(session, 12)
    assert seqs_of(frames) == list(range(1, 13))
    assert sorted(client.state.events) == list(range(1, 13))
    assert all(frames[i - 1] == client.state.events[i] for i in range(1, 13))


async def test_replay_from_floor_while_events_are_produced(daemon):
    """Reconnect with a floor in the middle while calls keep completing: the new socket gets
    every event after the floor exactly once, in order, across the replay/live seam."""
    (daemon.layout.workspace / "note.txt").write_text("x" * 100)
    client = daemon.client()
    cwd = str(daemon.layout.workspace)
    async with client.connect() as session:
        await session.bootstrap(cwd=cwd)
        await make_events(session, 50)
        # Fire 200 more calls and leave without waiting for them.
        for _ in range(200):
            await session.call("read_file", {"path": "note.txt"})
    floor = 20
    async with client.connect(ack_floor=floor) as session:
        await session.bootstrap(cwd=cwd)
        # More events produced while the replay is under way.
        async with trio.open_nursery() as nursery:
            async def produce():
                for _ in range(100):
                    await session.call("read_file", {"path": "note.txt"})
                    await trio.sleep(0)

            nursery.start_soon(produce)
            frames = await collect_replay(session, 350)
    assert seqs_of(frames) == list(range(floor + 1, 351))


async def test_ack_rules_and_pruning(daemon):
    (daemon.layout.workspace / "note.txt").write_text("x")
    client = daemon.client()
    cwd = str(daemon.layout.workspace)
    store = daemon.supervisor.store
    async with client.connect() as session:
        await session.bootstrap(cwd=cwd)
        await make_events(session, 10)
        await session.send("events.ack", {"seq": 11})
        frame = await session.receive()
        assert frame["kind"] == "error" and frame["body"]["code"] == "ack_ahead"
        await session.ack(6)
        await session.ack(3)  # lower: ignored, the floor never goes down
        await session.send("events.ack", {"seq": 0})
        await make_events(session, 1)  # a round trip, so the acks were processed
        snapshot = store.snapshot()
        assert snapshot.ack_floor == 6
        assert snapshot.oldest_retained_seq == 7
        assert [seq for seq, _ in store.events_after(0, 100)] == list(range(7, 12))
    # A reconnect whose floor is below oldestRetainedSeq - 1 is served from the oldest retained.
    fresh = daemon.client()
    fresh.state.generation = client.state.generation
    async with fresh.connect(ack_floor=2) as session:
        state = await session.bootstrap(cwd=cwd)
        assert state["body"]["oldestRetainedSeq"] == 7
        assert state["body"]["ackFloor"] == 6
        frames = await collect_replay(session, 11)
    assert seqs_of(frames) == list(range(7, 12))


async def test_client_that_stops_reading_does_not_block_producers(daemon):
    """While the client reads nothing, calls keep completing and journaling; afterwards the
    client receives every event in order."""
    (daemon.layout.workspace / "note.txt").write_text("y" * 1000)
    client = daemon.client()
    async with client.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        for _ in range(1500):
            await session.call("read_file", {"path": "note.txt"})
        with trio.fail_after(20):
            while daemon.supervisor.store.snapshot().local_event_max < 1500:
                await trio.sleep(0.01)
        frames = await collect_replay(session, 1500)
    assert seqs_of(frames) == list(range(1, 1501))


def test_frames_from_memory_match_the_store_including_pruning(tmp_path):
    """The sender's in-memory path and the sqlite path serve the same frames: same seqs,
    same bytes, and neither serves what an ack pruned."""
    from sandbox_supervisor.daemon.state.journal import RECENT_FRAMES, Journal
    from sandbox_supervisor.daemon.state.store import StateStore

    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        journal.append([("tool.result", tool_result(n=i, text="é\u2028")) for i in range(10)])
        assert journal.frames_after(3, 4) == store.events_after(3, 4)
        assert [seq for seq, _ in journal.frames_after(3, 4)] == [4, 5, 6, 7]
        journal.acknowledge(6)
        assert journal.frames_after(0, 100) == store.events_after(0, 100)
        assert [seq for seq, _ in journal.frames_after(0, 100)] == [7, 8, 9, 10]
        journal.append([("tool.result", tool_result(n=i)) for i in range(RECENT_FRAMES + 5)])
        # Older than what memory holds: served from the store, identically.
        assert journal.frames_after(7, 3) == store.events_after(7, 3)
        assert journal.frames_after(journal.last_seq - 2, 10) == store.events_after(journal.last_seq - 2, 10)


def test_frames_from_memory_match_the_store_from_either_end_of_the_window(tmp_path):
    """A batch from the newer half of the in-memory window is walked from its newest end, one
    from the older half from its oldest: both give the store's frames, at every position of a
    full window, for every limit and character budget."""
    from sandbox_supervisor.daemon.state.journal import RECENT_FRAMES, Journal
    from sandbox_supervisor.daemon.state.store import StateStore

    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        journal.append([("tool.result", tool_result(n=i, text="x" * (i % 7))) for i in range(RECENT_FRAMES + 3)])
        first, last = journal.recent[0].seq, journal.recent[-1].seq
        assert last - first + 1 == RECENT_FRAMES
        for after in (first - 1, first, first + 1, *range(first + RECENT_FRAMES // 2 - 2, first + RECENT_FRAMES // 2 + 3), last - 3, last - 2, last - 1):
            for limit in (1, 2, 5, RECENT_FRAMES):
                assert journal.frames_after(after, limit) == store.events_after(after, limit), (after, limit)
                assert journal.frames_after(after, limit, 200) == store.events_after(after, limit, 200), (after, limit)
        assert journal.frames_after(last, 5) == []


def test_recent_frames_in_memory_are_bounded_by_size_and_leave_when_acked(tmp_path):
    """The in-memory window is cut by size as well as count, from the oldest end only (so
    it stays dense and agrees with the store), and acked frames leave it."""
    from sandbox_supervisor.daemon.state.journal import RECENT_MAX_CHARS, Journal
    from sandbox_supervisor.daemon.state.store import StateStore

    big = "\x01" * 65536  # ~393 KB once JSON-escaped, like a read_file page of control bytes
    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        for _ in range(40):
            journal.append([("tool.result", tool_result(content=big))])
        held = sum(len(row.frame) for row in journal.recent)
        assert 0 < held <= RECENT_MAX_CHARS
        seqs = [row.seq for row in journal.recent]
        assert seqs == list(range(seqs[0], 41))  # dense, ending at the newest
        for after in (0, 20, seqs[0] - 1, seqs[0], 39):
            assert journal.frames_after(after, 8) == store.events_after(after, 8)
            assert journal.frames_after(after, 8, 1_000_000) == store.events_after(after, 8, 1_000_000)
        # A batch stops once it holds the budget (and always holds one frame).
        assert len(journal.frames_after(seqs[0] - 1, 8, 1_000_000)) == 3
        assert len(journal.frames_after(seqs[0] - 1, 8, 1)) == 1
        journal.acknowledge(38)
        assert [row.seq for row in journal.recent] == [39, 40]


async def test_large_results_do_not_pin_daemon_memory(tmp_path, authority):
    """300 read_file results of ~400 KB each (64 KiB of control bytes, escaped), read and
    acked by the client: the daemon's memory does not keep them."""
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d", authority=authority)
    (layout.workspace / "control.bin").write_bytes(b"\x01" * 65536)
    async with running_daemon(layout) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for _ in range(20):  # warm-up: first-use allocations are not growth
                await session.call_and_wait("read_file", {"path": "control.bin"})
            baseline = _rss_kib(process.proc.pid)
            for _ in range(300):
                result = await session.call_and_wait("read_file", {"path": "control.bin"})
                assert result["result"]["length"] == 65536
            await session.ack()  # everything received so far
            growth_mib = (_rss_kib(process.proc.pid) - baseline) / 1024
    assert process.returncode == 0
    print(f"daemon RSS growth over 300 large results: {growth_mib:.1f} MiB")
    assert growth_mib < 48  # 300 frames of ~400 KB would be ~115 MiB if memory kept them


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("VmRSS not found")


async def test_an_ack_the_database_refuses_is_kept_and_recorded_once_it_takes_writes(daemon, session):
    """The database refuses the ack's write (a real sqlite error: the daemon's own connection
    made read-only). The ack is the daemon's fault to retry, not the client's: it is answered
    as any ack (nothing sent, the socket stays usable), the floor does not move meanwhile, and
    the daemon records it by itself once the database takes writes again, with no new ack."""
    (daemon.layout.workspace / "note.txt").write_text("hi")
    await make_events(session, 2)
    store = daemon.supervisor.store
    store._conn.execute("PRAGMA query_only = ON")  # writes now fail: SQLITE_READONLY
    try:
        await session.ack(2)
        # The first frame back answers the ack after it: the refused one sent nothing.
        await session.send("events.ack", {"seq": 1000})
        frame = await session.receive_until(lambda f: f["kind"] == "error")
        assert frame["body"]["code"] == "ack_ahead"
        assert store.snapshot().ack_floor == 0
        assert daemon.supervisor.journal.deferred_ack == 2
    finally:
        store._conn.execute("PRAGMA query_only = OFF")
    with trio.fail_after(5):
        while store.snapshot().ack_floor != 2:
            await trio.sleep(0.02)
    # The socket still serves: a call after the refused ack is answered as usual.
    assert (await session.call_and_wait("read_file", {"path": "note.txt"}))["ok"] is True
