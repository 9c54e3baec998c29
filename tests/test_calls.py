"""The call runner over a real store and journal, with tools that misbehave: a bug in one
tool costs that call an `internal` result, never the session (or the daemon)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from sandbox_supervisor.protocol.tools import TOOL_SCOPES, tool_spec
from sandbox_supervisor.daemon.runtime.calls import CallContext, CallRunner
from sandbox_supervisor.daemon.state.keys import CallKey
from sandbox_supervisor.daemon.runtime.tool import RunningCall, Tool
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore

FIRST, SECOND = "6f1c1d2e-0000-4000-8000-000000000001", "6f1c1d2e-0000-4000-8000-000000000002"


def call(call_id: str, key: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"tool_name": "read_file", "call_id": call_id, "parameters": {"path": "f"}}
    if key is not None:
        body["idempotency_key"] = key
    return body


async def run_calls(tmp_path, tool: Tool, *bodies: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    context = CallContext(
        session_id="s", generation=1, cwd=str(tmp_path), agent_env={},
        scopes=frozenset(TOOL_SCOPES.values()), allowed_paths=None, allowed_commands=None,
    )
    replies: list[dict] = []

    async def reply(text: str) -> None:
        replies.append(json.loads(text))

    with StateStore.open(tmp_path / "state") as store:
        journal = Journal(store)
        async with trio.open_nursery() as nursery:
            runner = CallRunner(store, journal, nursery, {"read_file": tool})
            for body in bodies:
                await runner.submit(body, context, reply)
                await trio.testing.wait_all_tasks_blocked()
        results = [json.loads(frame)["body"] for _, frame in store.events_after(0, 10)]
        records = [store.call_record(CallKey(context.key_space, b["idempotency_key"])) for b in bodies if "idempotency_key" in b]
    assert all(r is not None and r.state == "completed" for r in records)  # no key left pending
    return results, replies


def unencodable(running: RunningCall) -> dict[str, Any]:
    # Not JSON: a lone surrogate cannot be UTF-8.
    return {"text": "\udcff"} if running.call.call_id == FIRST else {"text": "fine"}


@pytest.mark.parametrize("path", ["task", "inline"])
async def test_a_result_the_encoder_refuses_is_answered_internal_and_the_session_goes_on(tmp_path, path):
    async def run(running: RunningCall) -> dict[str, Any]:
        return unencodable(running)

    tool = Tool(tool_spec("read_file"), run=run, run_now=unencodable if path == "inline" else None)
    results, replies = await run_calls(tmp_path, tool, call(FIRST, "k1"), call(SECOND, "k2"))
    assert [(r["call_id"], r["ok"]) for r in results] == [(FIRST, False), (SECOND, True)]
    assert results[0]["error"]["code"] == "internal" and replies == []
