"""6. Reconnect with many unacked events (100,000; --quick 5,000) → all replayed.

Set-up: the daemon binds the session, is stopped, and the events are appended to its journal
directly with `StateStore.append_events` (the daemon's own store API; it is stopped, so the
journal is ours to append to), then the daemon is started again. The events are `exec.output`
bodies carrying a 200-character line (~370 bytes a frame).

Daemon: a new connection (next generation, ack floor 0) + bootstrap, until the last replayed
event has arrived; every frame is parsed and the seqs are checked to be dense. Nothing is
acked, so every sample replays every event.

Floor: a new connection to the floor server, one message asking it to SELECT `seq, frame_json`
of the same rows from the same sqlite file and send each as a message, until the last has
arrived (parsed the same way).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import trio

from bench.common import FRAME_TIMEOUT_S, CpuMeter, Mode, Result, daemon, floor_server, now, premint, time_ratio_result, workspace
from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore
from sandbox_supervisor.testing.daemon import running_daemon

NAME = "replay"
TARGET = 1.5
APPEND_BATCH = 10_000


def event_bodies(count: int) -> list[tuple[str, dict]]:
    call_id = str(uuid.uuid4())
    line = ("the quick brown fox jumps over the lazy dog " * 5)[:199] + "\n"
    return [
        (
            "exec.output",
            {
                "call_id": call_id,
                "stream": "stdout",
                "text": line,
                "offset": i * len(line),
                "bytes": len(line),
                "truncated": False,
                "dropped_bytes": 0,
                "after_exit": False,
            },
        )
        for i in range(count)
    ]


async def receive_all(ws, first_seq: int, last_seq: int) -> None:
    expected = first_seq
    with trio.fail_after(FRAME_TIMEOUT_S):
        while expected <= last_seq:
            frame = json.loads(await ws.get_message())
            seq = frame.get("seq")
            if seq is None:
                continue  # a reply that is not an event
            if seq != expected:
                raise RuntimeError(f"replay gap: expected seq {expected}, got {seq}")
            expected += 1


async def run(mode: Mode, workdir: Path) -> Result:
    count = mode.pick(100_000, 5_000)
    samples, warmup = mode.pick(5, 2), 1
    root = workdir / "daemon"

    # Bind the session, stop the daemon, journal the events while it is down.
    async with daemon(root) as (_, running):
        layout = running.layout
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(layout))
    store = StateStore.open(layout.state_dir)
    try:
        bodies = event_bodies(count)
        rows = []
        for start in range(0, count, APPEND_BATCH):
            rows += store.append_events(bodies[start:start + APPEND_BATCH])
    finally:
        store.close()
    first_seq, last_seq = rows[0][0], rows[-1][0]
    frame_bytes = sum(len(row.frame.encode()) for row in rows) / count

    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, running_daemon(layout) as process:
        running = process.running
        generation = client.state.generation
        client = running.client()  # the restarted daemon listens on a new port
        client.state.generation = generation
        db = str(layout.state_dir / DB_FILENAME)
        for i in range(warmup + samples):
            if i == warmup:
                meter = CpuMeter(process.proc.pid, fs.proc.pid)
            started = now()
            async with fs.connect() as ws:
                await ws.send_message("P" + json.dumps({"db": db, "after": 0}))
                await receive_all(ws, first_seq, last_seq)
                elapsed_floor = now() - started
            args = premint(client, ack_floor=0)
            started = now()
            async with client.connect(**args) as session:
                state = await session.bootstrap(cwd=workspace(layout))
                assert state["body"]["localEventMax"] == last_seq, state
                await receive_all(session.ws, first_seq, last_seq)
                elapsed = now() - started
            if i >= warmup:
                floor.append(elapsed_floor)
                measured.append(elapsed)
        meter.stop()
    note = f"{count:,} events of ~{frame_bytes:.0f} B; {meter.per_op(samples, 'ms')} per replay"
    return time_ratio_result(NAME, measured, floor, TARGET, note)
