"""The reference control-plane client (testing/client.py) answers calls the way docs/protocol.md §8
and 9 say a control plane must read the daemon: against a real daemon."""

from __future__ import annotations

import pytest
import trio

from sandbox_supervisor.testing.client import CallNotAnswered
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout


async def test_a_reused_call_id_gets_its_own_answer_not_the_earlier_result(daemon, session):
    call_id = "3c0d7a51-6a0f-4c39-9b0e-5a1d2b3c4d5e"
    first = await session.call_and_wait(
        "execute_shell_command", {"command": "true"}, idempotency_key="first", call_id=call_id
    )
    assert first["ok"] is True
    again = await session.call_and_wait(
        "execute_shell_command", {"command": "true"}, idempotency_key="second", call_id=call_id
    )
    assert again["ok"] is False and again["error"]["code"] == "invalid_parameters"


async def test_after_tool_pending_a_refusal_that_never_held_the_key_is_not_the_answer(tmp_path, authority):
    """A refused too_many_processes with key K (the key stays free); then B with K runs; a
    third call with K gets tool.pending and must wait for B's result, not take A's."""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"max_processes": 1})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            hog = await session.call("execute_shell_command", {"command": "sleep 0.5"}, idempotency_key="hog")
            refused = await session.call_and_wait("execute_shell_command", {"command": "sleep 0.5"}, idempotency_key="K")
            assert refused["error"]["code"] == "too_many_processes"
            await session.result(hog)
            runs = await session.call("execute_shell_command", {"command": "sleep 0.5; echo B"}, idempotency_key="K")
            duplicate = await session.call("execute_shell_command", {"command": "sleep 0.5; echo B"}, idempotency_key="K")
            answer = await session.result(duplicate)
            assert answer["call_id"] == runs and answer["ok"] is True
            assert "B" in answer["result"]["stdout"]["head"]


async def test_a_new_client_starts_its_ack_floor_at_the_daemons(daemon, session):
    for _ in range(3):
        await session.call_and_wait("read_file", {"path": "."})
    await session.ack()
    floor = session.client.state.acked
    assert floor >= 3
    fresh = daemon.client()  # another instance of the control plane: no events stored
    async with fresh.connect(generation=session.client.state.generation + 1) as other:
        await other.bootstrap(cwd=str(daemon.layout.workspace))
        assert fresh.state.acked == floor == fresh.state.ack_floor


async def test_a_result_that_could_not_be_recorded_is_a_retryable_refusal(daemon, session):
    (daemon.layout.workspace / "big.txt").write_bytes(b"x" * 65536)
    conn = daemon.supervisor.store._conn  # the daemon's own connection: a real SQLITE_FULL
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + 4}")
    keyed = await session.call("read_file", {"path": "big.txt"}, idempotency_key="k")
    with pytest.raises(CallNotAnswered) as refused:
        await session.result(keyed)
    assert refused.value.code == "internal" and refused.value.retryable
    conn.execute("PRAGMA max_page_count = 1073741823")
    # call_and_wait sends it again with the same key; the first execution's result answers.
    answer = await session.call_and_wait("read_file", {"path": "big.txt"}, idempotency_key="k")
    assert answer["call_id"] == keyed and answer["result"]["length"] == 65536
    with trio.fail_after(5):
        keyless = await session.call("read_file", {"path": "big.txt"})
        assert (await session.result(keyless))["ok"] is True
