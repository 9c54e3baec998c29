"""The journal on disk is bounded (docs/operations.md, "Faults and what the daemon does"): a
peer that stops reading loses its socket after websocket.write_timeout_s, its events kept;
past journal.max_unacked_bytes new calls are refused until the client acks; the database
file shrinks again once what the client acked is pruned."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import trio

from conftest import FAST_WEBSOCKET
from sandbox_supervisor.daemon.state.keys import OWNER_SPACE, CallKey
from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore
from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.client import CallNotAnswered, ControlClient, Endpoint
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

WRITE_TIMEOUT_S = 0.5
PAGE = 65536  # read_file's largest page: one ~64 KiB event per call
# Enough result frames to fill the unix socket's buffers and the reference client's queue of
# 64 messages.
CALLS = 128
DEADLINE_S = 10.0
# About 10 MiB of events: well above what the daemon leaves free (4 MiB) before giving back.
GROWTH_CALLS = 160
INCREMENTAL = 2  # what PRAGMA auto_vacuum reads for INCREMENTAL


async def test_a_peer_that_stops_reading_is_closed_after_the_write_timeout_and_its_events_stay(
    tmp_path: Path, authority: LoopbackAuthority, log_lines
) -> None:
    layout = make_layout(
        tmp_path / "daemon", authority=authority, websocket={**FAST_WEBSOCKET, "write_timeout_s": WRITE_TIMEOUT_S}
    )
    (layout.workspace / "page.txt").write_text("x" * PAGE)
    async with in_process_daemon(layout) as daemon:
        assert daemon.supervisor is not None
        hub = daemon.supervisor.hub
        client = ControlClient(Endpoint(unix=str(layout.unix_socket)), layout.authority, sandbox_id=layout.sandbox_id)
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for _ in range(CALLS):  # sent, never read
                await session.call("read_file", {"path": "page.txt"})
            with trio.fail_after(DEADLINE_S):
                while hub.open:
                    await trio.sleep(0.02)
        closed = [line for line in log_lines() if line["event"] == "socket.closed"]
        assert [(line["code"], line["reason"]) for line in closed] == [
            (closes.CLOSE_INTERNAL_ERROR, closes.WRITE_TIMEOUT_REASON)
        ]
        # Nothing was lost: a new socket gets every result.
        fresh = ControlClient(Endpoint(unix=str(layout.unix_socket)), layout.authority, sandbox_id=layout.sandbox_id)
        fresh.state.generation = client.state.generation
        async with fresh.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            with trio.fail_after(DEADLINE_S):
                while len(fresh.state.results()) < CALLS:
                    await session.receive()


async def test_past_the_unacked_cap_calls_are_refused_until_the_client_acks(tmp_path: Path, authority: LoopbackAuthority) -> None:
    cap = 7 * PAGE // 2  # three results of a page each fit, the fourth goes past it
    layout = make_layout(
        tmp_path / "daemon", authority=authority, websocket=dict(FAST_WEBSOCKET), journal={"max_unacked_bytes": cap}
    )
    (layout.workspace / "page.txt").write_text("x" * PAGE)
    async with in_process_daemon(layout) as daemon:
        assert daemon.supervisor is not None
        journal = daemon.supervisor.journal
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for index in range(4):
                assert (await session.call_and_wait("read_file", {"path": "page.txt"}, idempotency_key=f"k{index}"))["ok"]
            assert journal.unacked_bytes > cap
            last_seq = journal.last_seq

            with pytest.raises(CallNotAnswered) as refused:
                await session.call_and_wait("read_file", {"path": "page.txt"}, idempotency_key="over")
            assert refused.value.code == errors.JOURNAL_FULL
            assert journal.last_seq == last_seq  # nothing journaled, not even the refusal
            assert daemon.supervisor.store.call_record(CallKey(OWNER_SPACE, "over")) is None  # key free

            await session.ack()
            with trio.fail_after(DEADLINE_S):  # the ack is a frame: wait until it is taken
                while journal.unacked_bytes > cap:
                    await trio.sleep(0.02)
            assert journal.unacked_bytes == 0
            assert (await session.call_and_wait("read_file", {"path": "page.txt"}, idempotency_key="over"))["ok"]
        # Every event arrived once, none dropped: seqs dense from 1.
        assert sorted(client.state.events) == list(range(1, journal.last_seq + 1))


async def test_the_database_file_gives_space_back_after_the_client_acks(tmp_path: Path, authority: LoopbackAuthority) -> None:
    layout = make_layout(tmp_path / "daemon", authority=authority, websocket=dict(FAST_WEBSOCKET))
    (layout.workspace / "page.txt").write_text("x" * PAGE)
    database = layout.state_dir / DB_FILENAME
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            for _ in range(GROWTH_CALLS):  # unkeyed: no record keeps their results after the ack
                assert (await session.call_and_wait("read_file", {"path": "page.txt"}))["ok"]
            checkpoint = sqlite3.connect(database)  # the WAL into the file, to measure it
            try:
                checkpoint.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            finally:
                checkpoint.close()
            grown = database.stat().st_size
            assert grown > GROWTH_CALLS * PAGE
            await session.ack()
            with trio.fail_after(DEADLINE_S):
                while database.stat().st_size > grown // 4:
                    await trio.sleep(0.05)


def test_a_database_from_before_incremental_vacuum_is_converted_once_at_open(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    legacy = sqlite3.connect(state / DB_FILENAME)
    legacy.execute("PRAGMA journal_mode=WAL")
    legacy.execute("CREATE TABLE older (x TEXT)")  # a table: auto_vacuum can no longer change alone
    legacy.close()
    with StateStore.open(state) as store:
        assert store._conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL
