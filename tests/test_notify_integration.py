"""sd_notify against a real AF_UNIX datagram socket, with the daemon as a real subprocess
(READY, STATUS, WATCHDOG cadence, STOPPING; no READY when the configuration is bad)."""

from __future__ import annotations

import json
import signal
import socket
import statistics

import trio

from sandbox_supervisor.testing.client import Endpoint, http_request
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

WATCHDOG_USEC = 400_000  # pings expected every 0.2 s


class NotifyListener:
    """Plays systemd's side of sd_notify: one datagram per message."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.messages: list[tuple[float, str]] = []

    async def bind(self) -> None:
        await self.sock.bind(self.path)

    async def next(self, timeout: float = 20) -> str:
        with trio.fail_after(timeout):
            data = await self.sock.recv(4096)
        text = data.decode()
        self.messages.append((trio.current_time(), text))
        return text

    async def until(self, line: str, timeout: float = 20) -> None:
        with trio.fail_after(timeout):
            while line not in (await self.next(timeout)).split("\n"):
                pass

    def close(self) -> None:
        self.sock.close()


async def test_ready_watchdog_and_stopping(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    listener = NotifyListener(tmp_path / "notify.sock")
    await listener.bind()
    env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    try:
        # wait_ready=False: READY=1 on the notify socket is what this test waits for.
        async with running_daemon(layout, env=env, wait_ready=False) as process:
            await listener.until("READY=1")
            # READY means the listeners answer: health over both, without waiting any further.
            listening = json.loads((layout.state_dir / "listening.json").read_text())
            for endpoint in (Endpoint.parse(listening["tcp"][0]), Endpoint(unix=listening["unix"][0])):
                assert (await http_request(endpoint, "GET", "/healthz")).status == 200
            assert any("STATUS=" in text for _, text in listener.messages)

            pings = []
            with trio.move_on_after(1.3):
                while True:
                    if await listener.next() == "WATCHDOG=1":
                        pings.append(trio.current_time())
            gaps = [b - a for a, b in zip(pings, pings[1:])]
            assert len(pings) >= 4
            # Half of WATCHDOG_USEC, roughly: never early, and typically on time (the median;
            # one late ping on a loaded machine is not what this checks).
            assert all(gap > 0.1 for gap in gaps) and statistics.median(gaps) < 0.4, gaps

            process.send_signal(signal.SIGTERM)
            await listener.until("STOPPING=1")
            assert await process.wait() == 0
    finally:
        listener.close()


async def test_no_ready_when_the_configuration_is_invalid(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.jwks_file.write_text(json.dumps({"keys": [authority.signing_jwk()]}))  # a private key
    listener = NotifyListener(tmp_path / "notify.sock")
    await listener.bind()
    try:
        async with running_daemon(layout, env={"NOTIFY_SOCKET": listener.path}, wait_ready=False) as process:
            assert await process.wait(timeout=15) == 2
        with trio.move_on_after(0.3):
            while True:
                await listener.next()
        assert all("READY=1" not in text for _, text in listener.messages)
    finally:
        listener.close()


async def test_terminated_daemon_reports_stopping_at_start(tmp_path, authority):
    from sandbox_supervisor.daemon.state.store import StateStore

    layout = make_layout(tmp_path / "d", authority=authority)
    with StateStore.open(layout.state_dir) as store:
        store.mark_terminated("session_binding_mismatch", "test", 0.0)
    listener = NotifyListener(tmp_path / "notify.sock")
    await listener.bind()
    try:
        async with running_daemon(layout, env={"NOTIFY_SOCKET": listener.path}, wait_ready=False) as process:
            await listener.until("STOPPING=1")
            assert await process.wait(timeout=15) == 78
        assert all("READY=1" not in text for _, text in listener.messages)
    finally:
        listener.close()


# How long the daemon is kept stopped: several ping intervals (half of WATCHDOG_USEC).
STOPPED_S = 1.0
# Everything queued meanwhile is answered within this much of SIGCONT (~0.1 s unloaded).
RESUME_BOUND_S = 1.0
# A ping the daemon sent just before the stop may be read this much later.
STRAGGLER_S = 0.1


async def test_a_stopped_daemon_answers_and_pings_at_once_when_continued(tmp_path, authority):
    """SIGSTOP (docs/operations.md, "The daemon stopped"): while stopped, no WATCHDOG=1 goes
    out, so the stall shows up whole in the gap systemd's watchdog judges; at SIGCONT the pings
    resume and a call sent meanwhile is answered at once, nothing lost."""
    layout = make_layout(tmp_path / "d", authority=authority)
    (layout.workspace / "f.txt").write_text("hello\n")
    listener = NotifyListener(tmp_path / "notify.sock")
    await listener.bind()
    env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    pings: list[float] = []

    async def collect_pings() -> None:
        while True:
            if await listener.next(timeout=60) == "WATCHDOG=1":
                pings.append(trio.current_time())

    try:
        async with running_daemon(layout, env=env) as process:
            client = process.running.client()
            async with client.connect() as session, trio.open_nursery() as nursery:
                await session.bootstrap(cwd=str(layout.workspace))
                nursery.start_soon(collect_pings)
                await listener_pinged(pings, 2)
                process.send_signal(signal.SIGSTOP)
                stopped_at = trio.current_time()
                call_id = await session.call("read_file", {"path": "f.txt"}, idempotency_key="while-stopped")
                await trio.sleep(STOPPED_S)  # the stall itself, not a wait for a condition
                before = len(pings)
                continued_at = trio.current_time()
                process.send_signal(signal.SIGCONT)
                result = await session.result(call_id, timeout=10)
                answered_at = trio.current_time()
                await listener_pinged(pings, before + 1)
                nursery.cancel_scope.cancel()
    finally:
        listener.close()
    assert result["ok"] is True and result["result"]["content"] == "hello\n"
    assert answered_at - continued_at < RESUME_BOUND_S
    # Silent while stopped (a ping sent just before the stop may be read a moment late), so
    # the gap systemd sees is the whole stall plus up to one ping interval before it.
    assert not [t for t in pings if stopped_at + STRAGGLER_S < t < continued_at]
    resumed = next(t for t in pings if t > continued_at)
    assert resumed - continued_at < RESUME_BOUND_S


async def listener_pinged(pings: list[float], count: int) -> None:
    with trio.fail_after(10):
        while len(pings) < count:
            await trio.sleep(0.01)
