"""The output pipeline without a daemon: real pipes in, a real journal (sqlite) and spool out."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from sandbox_supervisor.protocol.fields import STREAMS, Stream
from sandbox_supervisor.daemon.runtime.command_output import (
    CommandOutput,
    OutputLimits,
    PRUNE_SLACK_DIVISOR,
    SpoolBudget,
    StreamOutput,
)
from sandbox_supervisor.daemon.runtime.output import LiveOutput
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter, read_state, spool_dir, spool_usage, stream_path
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore

DEADLINE_S = 10
POLL_S = 0.01
FAST = OutputLimits(throttle_ms=10, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1 << 20)
# A window no test outlasts: after the leading-edge chunk, bytes wait for a final flush.
NEVER_DUE = OutputLimits(throttle_ms=600_000, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1 << 20)


@dataclass
class SpoolCounter:
    """Implements OutputTelemetry: what the pipeline reports as spooled."""

    calls: list[int] = field(default_factory=list)

    def output_spooled(self, nbytes: int) -> None:
        self.calls.append(nbytes)


@dataclass
class Rig:
    output: CommandOutput
    writers: dict[Stream, trio.lowlevel.FdStream]
    store: StateStore
    state_dir: Path
    telemetry: SpoolCounter

    def events(self) -> list[dict[str, Any]]:
        frames = [json.loads(frame) for _, frame in self.store.events_after(0, 10_000)]
        return [f["body"] for f in frames if f["kind"] == "exec.output"]

    async def wait_for_event(self, text: str) -> dict[str, Any]:
        with trio.fail_after(DEADLINE_S):
            while True:
                for event in self.events():
                    if text in event["text"]:
                        return event
                await trio.sleep(POLL_S)

    async def close_writers(self) -> None:
        for writer in self.writers.values():
            await writer.aclose()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    with StateStore.open(tmp_path / "state") as opened:
        yield opened


@asynccontextmanager
async def pumping(store: StateStore, limits: OutputLimits = FAST) -> AsyncIterator[Rig]:
    """A CommandOutput pumping two real pipes, in a nursery that must end on its own: the test
    completes the call and closes the pipes, or the deadline fails it."""
    state_dir = store.path.parent
    telemetry = SpoolCounter()
    output = CommandOutput.open(state_dir, str(uuid.uuid4()), limits, Journal(store), telemetry)
    readers: dict[Stream, trio.lowlevel.FdStream] = {}
    writers: dict[Stream, trio.lowlevel.FdStream] = {}
    for name in STREAMS:
        read_fd, write_fd = os.pipe()
        readers[name] = trio.lowlevel.FdStream(read_fd)
        writers[name] = trio.lowlevel.FdStream(write_fd)
    rig = Rig(output, writers, store, state_dir, telemetry)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(output.pump, readers)
            yield rig
            await rig.close_writers()  # idempotent: a test may have closed them already


def spooled(rig: Rig, name: Stream) -> bytes:
    path = stream_path(rig.state_dir, rig.output.call_id, name)
    return path.read_bytes() if path.exists() else b""


async def test_every_byte_reaches_the_spool_and_the_live_events_in_order(store):
    payload = bytes(range(32, 127)) * 3000  # 285,000 bytes: many reads, many chunks
    async with pumping(store) as rig:
        await rig.writers["stdout"].send_all(payload)
        await rig.writers["stderr"].send_all(b"err\n")
        await rig.close_writers()
        await rig.output.closed.wait()
        final = rig.output.final_events(trio.current_time() * 1000)
        rig.output.complete()
    output = rig.output
    assert output.finished.is_set()
    assert spooled(rig, "stdout") == payload and spooled(rig, "stderr") == b"err\n"
    assert not output.writer_alive("stdout") and not output.writer_alive("stderr")
    assert output.spooled_bytes == len(payload) + 4
    assert sum(rig.telemetry.calls) == len(payload) + 4
    # The live view is lossy (the reader outruns the throttle), but the journaled events and
    # the call's final ones chain exactly: each starts where the previous ended plus what it
    # says was dropped, and together they reach the stream's end.
    events = [e for e in rig.events() + [body for _, body in final] if e["stream"] == "stdout"]
    offset = 0
    for event in events:
        assert event["offset"] == offset + event["dropped_bytes"]
        offset = event["offset"] + event["bytes"]
    assert offset == len(payload)
    assert not any(e["after_exit"] for e in events)
    summary = output.summary_body("stdout")
    assert summary["bytes"] == len(payload) and summary["truncated"] is False
    assert payload.decode().startswith(summary["head"]) and payload.decode().endswith(summary["tail"])
    assert output.summary_body("stderr") == {"bytes": 4, "head": "err\n", "tail": "", "truncated": False}


async def test_bytes_inside_a_throttle_window_wait_for_the_calls_final_flush(store):
    async with pumping(store, NEVER_DUE) as rig:
        output = rig.output
        await rig.writers["stdout"].send_all(b"a")
        first = await rig.wait_for_event("a")  # leading edge: the first bytes go at once
        await rig.writers["stdout"].send_all(b"b")
        with trio.fail_after(DEADLINE_S):
            while output.streams["stdout"].live.buffered < 1:
                await trio.sleep(POLL_S)
        await rig.close_writers()
        await output.closed.wait()
        # Both pipes are closed, but the call has not completed: the tasks go on.
        await trio.testing.wait_all_tasks_blocked()
        assert not output.finished.is_set()
        final = output.final_events(trio.current_time() * 1000)
        output.complete()
    assert first["offset"] == 0 and first["after_exit"] is False
    assert [(kind, body["text"], body["offset"], body["after_exit"]) for kind, body in final] == [
        ("exec.output", "b", 1, False)
    ]
    assert [e["text"] for e in rig.events()] == ["a"]  # the final flush is the call's to journal


async def test_output_after_the_call_completed_is_marked_after_exit(store):
    async with pumping(store) as rig:
        output = rig.output
        await rig.writers["stdout"].send_all(b"before\n")
        await rig.wait_for_event("before")
        assert output.final_events(trio.current_time() * 1000) == []
        output.complete()
        await rig.writers["stdout"].send_all(b"after\n")
        later = await rig.wait_for_event("after")
        await rig.close_writers()
    assert later["after_exit"] is True and later["offset"] == len(b"before\n")
    assert [e["after_exit"] for e in rig.events()] == [False, True]
    assert spooled(rig, "stdout") == b"before\nafter\n"


async def test_the_spool_cap_is_reported_and_only_kept_bytes_are_counted(store):
    limits = OutputLimits(throttle_ms=10, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1000)
    async with pumping(store, limits) as rig:
        await rig.writers["stdout"].send_all(b"x" * 5000)
        await rig.close_writers()
        await rig.output.closed.wait()
        rig.output.complete()
    assert spooled(rig, "stdout") == b"x" * 1000
    assert sum(rig.telemetry.calls) == 1000 and rig.output.spooled_bytes == 1000
    summary = rig.output.summary_body("stdout")
    assert summary["bytes"] == 5000 and summary["truncated"] is True


async def test_a_journal_that_refuses_costs_live_events_not_the_output(store, log_lines):
    async with pumping(store) as rig:
        store.close()  # every append now raises StoreError
        await rig.writers["stdout"].send_all(b"kept anyway\n")
        await rig.close_writers()
        await rig.output.closed.wait()
        rig.output.complete()
    assert rig.output.finished.is_set()
    assert spooled(rig, "stdout") == b"kept anyway\n"
    refused = [entry for entry in log_lines() if entry["event"] == "exec.output_not_journaled"]
    assert refused and all(entry["call_id"] == rig.output.call_id for entry in refused)


async def test_pump_refuses_pipes_that_do_not_match_the_streams_and_still_closes_the_spools(store):
    output = CommandOutput.open(store.path.parent, str(uuid.uuid4()), FAST, Journal(store))
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    async with trio.lowlevel.FdStream(read_fd) as only_stdout:
        with pytest.raises(ValueError):
            await output.pump({"stdout": only_stdout})
    assert output.finished.is_set() and not output.writer_alive("stdout")


def test_a_command_output_has_exactly_the_protocols_streams(store, tmp_path):
    spool = SpoolWriter(tmp_path / "s" / "stdout", 10)
    stream = StreamOutput(spool, LiveOutput(10, 4096, 65536))
    with pytest.raises(ValueError):
        CommandOutput(str(uuid.uuid4()), {"stdout": stream}, Journal(store))


def test_open_refuses_a_call_that_already_has_a_spool(store):
    call_id = str(uuid.uuid4())
    stream_path(store.path.parent, call_id, "stdout").parent.mkdir(parents=True)
    stream_path(store.path.parent, call_id, "stdout").write_bytes(b"earlier")
    with pytest.raises(FileExistsError):
        CommandOutput.open(store.path.parent, call_id, FAST, Journal(store))


def write_spool(state_dir: Path, call_id: str, size: int, mtime: float) -> None:
    writer = SpoolWriter(stream_path(state_dir, call_id, "stdout"), size)
    writer.write(b"x" * size)
    writer.close()
    for item in spool_dir(state_dir, call_id).iterdir():
        os.utime(item, (mtime, mtime))
    os.utime(spool_dir(state_dir, call_id), (mtime, mtime))


async def test_spool_budget_counts_the_disk_and_prunes_the_oldest_unkept(tmp_path):
    oldest, middle, newest = (str(uuid.uuid4()) for _ in range(3))
    for age, call_id in enumerate((newest, middle, oldest)):
        write_spool(tmp_path, call_id, 100, mtime=1_000_000 - age * 1000)
    sidecars = sum(u.bytes for u in spool_usage(tmp_path)) - 300  # .state files count too
    budget = SpoolBudget(tmp_path, cap_bytes=250 + sidecars)
    assert budget.bytes == 300 + sidecars
    assert budget.over_cap  # already past the cap
    await budget.prune(keep={oldest})  # the oldest is still running: never pruned
    assert not spool_dir(tmp_path, middle).exists()
    assert spool_dir(tmp_path, oldest).exists() and spool_dir(tmp_path, newest).exists()
    assert budget.bytes == sum(u.bytes for u in spool_usage(tmp_path))
    assert not budget.over_cap


async def test_a_prune_takes_only_finished_spools(tmp_path, store):
    """Over the cap with nothing kept by the caller, a prune still leaves every spool that may
    be written: a stream whose writer is open, a held process's without its exit record, and
    a command's that has written nothing yet (known only to the process that runs it)."""
    state_dir = store.path.parent
    finished, writing, held, silent = (str(uuid.uuid4()) for _ in range(4))
    for age, call_id in enumerate((finished, writing, held)):
        write_spool(state_dir, call_id, 100, mtime=1_000_000 - age * 1000)  # all older than `finished`
    open_writer = SpoolWriter(stream_path(state_dir, writing, "stderr"), 100)
    open_writer.write(b"still running")
    (spool_dir(state_dir, held) / "spec.json").write_text("{}")
    output = CommandOutput.open(state_dir, silent, FAST, Journal(store))
    budget = SpoolBudget(state_dir, cap_bytes=0)
    await budget.prune(keep=set())
    assert not spool_dir(state_dir, finished).exists()
    assert all(spool_dir(state_dir, c).exists() for c in (writing, held, silent))
    # Once they end, they are finished like any other.
    open_writer.close()
    (spool_dir(state_dir, held) / "exit.json").write_text("{}")
    output.close()
    await budget.prune(keep=set())
    assert spool_usage(state_dir) == []
    assert budget.bytes == 0


async def test_prunes_run_one_at_a_time(tmp_path, monkeypatch):
    """Prunes asked for together (commands finishing at once) never scan and delete side by
    side, where each would trip over what the other removed: one pass runs, and takes the
    others' requests over."""
    import threading
    import time

    for age in range(20):
        write_spool(tmp_path, str(uuid.uuid4()), 100, mtime=1_000_000 - age * 1000)
    running, most, lock = [0], [0], threading.Lock()
    real = trio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        def slow(*inner: Any) -> Any:
            time.sleep(0.05)  # long enough for the other requests to arrive meanwhile
            return fn(*inner)

        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return await real(slow, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)  # the budget's worker threads
    budget = SpoolBudget(tmp_path, cap_bytes=500)
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(budget.prune, set())
    assert most[0] == 1
    assert sum(u.bytes for u in spool_usage(tmp_path)) <= 500 == budget.cap_bytes
    assert budget.bytes == sum(u.bytes for u in spool_usage(tmp_path))


async def test_a_stream_cut_by_a_full_budget_never_keeps_bytes_after_the_gap(store):
    """Running commands' spools alone at the cap: new bytes are dropped (counted, the stream
    truncated, the on-disk state saying so); when a finished spool is pruned there is room
    again, but only for streams that dropped nothing: a byte kept after a dropped one would
    sit at that one's offset."""
    state_dir = store.path.parent
    cut, quiet, fresh = (str(uuid.uuid4()) for _ in range(3))
    budget = SpoolBudget(state_dir, cap_bytes=500)  # room for the `.state` files left
    outputs = {c: CommandOutput.open(state_dir, c, FAST, Journal(store), budget=budget) for c in (cut, quiet, fresh)}
    assert outputs[cut].streams["stdout"].feed(b"a" * 450) == 450
    assert not budget.full
    await budget.prune(need=100)  # what the reader does before a write past the cap
    assert budget.full  # nothing finished to take: the 100 bytes do not fit
    cut_stdout = outputs[cut].streams["stdout"]
    assert cut_stdout.feed(b"b" * 100) == 50  # up to the cap exactly
    assert outputs[quiet].streams["stdout"].feed(b"q") == 0
    assert (cut_stdout.spool.total, cut_stdout.spool.size, budget.bytes) == (550, 500, 500)
    state = read_state(stream_path(state_dir, cut, "stdout"))
    assert state is not None and state.truncated and not state.ended
    assert cut_stdout.summary_body()["truncated"] is True
    # The cut command ends: its spool is pruned, and the budget has room again...
    outputs[cut].close()
    await budget.prune()
    assert not spool_dir(state_dir, cut).exists() and not budget.full
    assert outputs[fresh].streams["stdout"].feed(b"f" * 5) == 5
    # ... but not for a stream that has dropped bytes.
    assert outputs[quiet].streams["stdout"].feed(b"q") == 0
    for output in outputs.values():
        output.close()
    assert stream_path(state_dir, fresh, "stdout").read_bytes() == b"f" * 5
    assert stream_path(state_dir, quiet, "stdout").read_bytes() == b""


async def test_a_prune_for_a_write_frees_a_slack_beyond_it(tmp_path):
    """A command printing on at the cap must not cost a disk scan per pipe read: the prune a
    write asks for frees a sixteenth of the cap more than the write needs."""
    for age in range(40):
        write_spool(tmp_path, str(uuid.uuid4()), 100, mtime=1_000_000 - age * 1000)
    cap = sum(u.bytes for u in spool_usage(tmp_path))  # exactly full of finished spools
    budget = SpoolBudget(tmp_path, cap_bytes=cap)
    await budget.prune(need=1)
    assert budget.bytes <= cap - 1 - cap // PRUNE_SLACK_DIVISOR
    assert budget.bytes == sum(u.bytes for u in spool_usage(tmp_path)) and not budget.full
