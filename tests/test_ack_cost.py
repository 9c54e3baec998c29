"""An ack's cost must not grow with the idempotency records kept (docs/protocol.md §9).

Since results are stored once, every completed record keeps its tool.result row below the
ack floor, and the ack's `DELETE FROM events WHERE seq <= floor AND seq NOT IN (SELECT
result_seq FROM idempotency …)` walks all of them (and builds the NOT IN set from every
record) on every ack: ~9 ms per ack with 20,000 kept keyed results on this machine against
0.09 ms before, on the socket's reader (the trio thread). Counted here in sqlite VM steps,
so the test is deterministic: an ack after one new event should cost about the same whether
200 or 4,000 results are kept.
"""

from __future__ import annotations

import uuid

import pytest

from sandbox_supervisor.daemon.state.store import StateStore
from sandbox_supervisor.daemon.state.keys import owner_key


def _body(key: str | None) -> dict:
    return {
        "call_id": str(uuid.uuid4()),
        "idempotency_key": key,
        "tool_name": "read_file",
        "ok": False,
        "error": {"code": "not_found", "message": "m"},
    }


def _ack_steps(tmp_path, kept: int) -> int:
    with StateStore.open(tmp_path / f"s{kept}") as store:
        for i in range(kept):
            key = f"k{i}"
            store.begin_call(key=owner_key(key), tool_name="read_file", digest="d", call_id=str(uuid.uuid4()), intent_json="{}")
            store.complete_call(owner_key(key), _body(key))
        store.raise_ack_floor(store.snapshot().local_event_max)
        store.append_events([("tool.result", _body(None))])
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        store._conn.set_progress_handler(count, 1)
        store.raise_ack_floor(store.snapshot().local_event_max)
        store._conn.set_progress_handler(None, 1)
        return steps



def test_an_ack_costs_the_same_however_many_results_are_kept(tmp_path):
    small, large = _ack_steps(tmp_path, 200), _ack_steps(tmp_path, 4000)
    assert large < 2 * small, (small, large)
