"""The drain at a stop delivers what it journaled (docs/protocol.md §10.1), with the daemon
as a real subprocess."""

from __future__ import annotations

import signal

import trio
import trio_websocket

from sandbox_supervisor.testing.client import ControlSession
from sandbox_supervisor.testing.daemon import DaemonLayout, DaemonProcess, make_layout, running_daemon

# Results the client leaves unread before the stop: 64 of them fill its library's message
# queue, and the rest (≈60 KB each) more than fill the unix socket's buffer (≈208 KiB), so
# the daemon's sender is blocked in a send when the drain begins.
UNREAD_RESULTS = 96
PAGE_TEXT = "x" * 60_000
KILL_GRACE_MS = 200
STUBBORN = "trap '' TERM; echo ready; sleep 30"
STOP_SLACK_S = 5.0


def finished(process: DaemonProcess, tool: str) -> set[str]:
    """The call ids of the `tool` calls whose result the daemon has journaled (and logged)."""
    return {e["call_id"] for e in process.log_events() if e.get("event") == "tool.finished" and e.get("tool") == tool}


async def fall_behind(session: ControlSession, process: DaemonProcess, layout: DaemonLayout) -> str:
    """Start a command that ignores SIGTERM, then leave a backlog of results unread until the
    daemon's sender is stuck in a send; the stubborn command's call id."""
    (layout.workspace / "page.txt").write_text(PAGE_TEXT)
    await session.bootstrap(cwd=str(layout.workspace))
    stubborn = await session.call("execute_shell_command", {"command": STUBBORN}, idempotency_key="stubborn")
    # Signal only once the trap is in place (before it, SIGTERM would simply work).
    await session.receive_until(lambda f: f["kind"] == "exec.output" and "ready" in f["body"]["text"])
    for i in range(UNREAD_RESULTS):
        await session.call("read_file", {"path": "page.txt"}, idempotency_key=f"page-{i}")
    with trio.fail_after(20):
        while len(finished(process, "read_file")) < UNREAD_RESULTS:
            await trio.sleep(0.05)
    return stubborn


async def test_drain_sends_every_journaled_event_before_closing(tmp_path, authority):
    """A client that is behind when the stop begins, and a command that ignores SIGTERM: the
    stubborn command's result is journaled after the grace, and the socket is closed 1001 only
    once everything journaled, that result included, has been sent."""
    layout = make_layout(
        tmp_path / "d",
        authority=authority,
        exec={"kill_grace_ms": KILL_GRACE_MS},
        websocket={"drain_budget_s": 20.0},  # room for a loaded machine; the flush takes ms
    )
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client(running.unix)
        async with client.connect() as session:
            stubborn = await fall_behind(session, process, layout)
            process.send_signal(signal.SIGTERM)
            # The stubborn command's result is journaled after the kill grace, and the drain
            # goes on to close the socket while the client is still behind. Only now does
            # the client read.
            with trio.fail_after(20):
                while stubborn not in finished(process, "execute_shell_command"):
                    await trio.sleep(0.05)
            with trio.fail_after(30):
                try:
                    while True:
                        await session.receive()
                except trio_websocket.ConnectionClosed as exc:
                    reason = exc.reason
        assert await process.wait(timeout=30) == 0
    events = client.state.events
    results = {f["body"]["call_id"]: f["body"] for f in events.values() if f["kind"] == "tool.result"}
    assert results[stubborn]["ok"] is True and results[stubborn]["result"]["signal"] == "SIGKILL"
    assert sorted(events) == list(range(1, max(events) + 1))
    assert sum(1 for body in results.values() if body["tool_name"] == "read_file") == UNREAD_RESULTS
    # A clean close after the last event: no frame was cut off by it.
    assert reason is not None and (reason.code, reason.reason) == (1001, "Supervisor listener stopping.")
    assert not any(e.get("event") == "drain.flush_incomplete" for e in process.log_events())


async def test_a_client_that_never_reads_costs_the_drain_its_budget_only(tmp_path, authority):
    """The flush waits for a client at most `websocket.drain_budget_s`, says so in the log,
    and what was not sent is replayed at the next connection."""
    budget = 0.3
    layout = make_layout(
        tmp_path / "d", authority=authority, exec={"kill_grace_ms": KILL_GRACE_MS}, websocket={"drain_budget_s": budget}
    )
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client(running.unix)
        async with client.connect() as session:
            stubborn = await fall_behind(session, process, layout)
            started = trio.current_time()
            process.send_signal(signal.SIGTERM)
            assert await process.wait(timeout=30) == 0
            elapsed = trio.current_time() - started
        # The grace, the flush and the close handshake, plus slack for a loaded machine: far
        # below the 30 s a flush without a budget would wait for this client.
        assert elapsed < KILL_GRACE_MS / 1000 + 2 * budget + STOP_SLACK_S
        incomplete = [e for e in process.log_events() if e.get("event") == "drain.flush_incomplete"]
        assert len(incomplete) == 1 and incomplete[0]["budget_s"] == budget
        behind, last_seq = incomplete[0]["cursors"], incomplete[0]["last_seq"]
        assert len(behind) == 1 and behind[0] < last_seq

        running = await process.start()
        client.endpoint = running.unix
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result = await session.result(stubborn)
    assert result["ok"] is True and result["result"]["signal"] == "SIGKILL"
