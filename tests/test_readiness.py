"""Readiness (`/readyz`) beside liveness (`/healthz`): a daemon started as users start it
(`serve` in a subprocess) without a sandbox id is alive (200) but not ready (503, naming the
missing id), warns once at start, and becomes ready as soon as the id is there."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from sandbox_supervisor.daemon.auth.identity import SANDBOX_ID_ENV, SandboxIdentity
from sandbox_supervisor.daemon.edge.http_front import RequestHead, Route, RoutePaths, classify
from sandbox_supervisor.testing.client import http_request
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

READY_WAIT_S = 10.0


@pytest.fixture(autouse=True)
def _no_sandbox_id_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon subprocess inherits the test's environment; an id there would be a fallback.
    monkeypatch.delenv(SANDBOX_ID_ENV, raising=False)


async def test_without_a_sandbox_id_the_daemon_is_alive_not_ready_and_says_why(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.sandbox_id_file.unlink()
    async with running_daemon(layout) as process:
        endpoint = process.running.tcp
        health = await http_request(endpoint, "GET", "/healthz")
        ready = await http_request(endpoint, "GET", "/readyz")
        assert health.status == 200 and health.json()["status"] == "ok"  # liveness
        assert ready.status == 503
        assert ready.header("content-type") == "application/json"
        body = ready.json()
        assert body["status"] == "not_ready"
        assert body["checks"] == {"state": "ok", "keys": "ok", "sandboxId": "missing"}
        assert body["detail"] == {
            "sandboxId": f"{layout.sandbox_id_file} does not exist and {SANDBOX_ID_ENV} is not set"
        }
        # The same answer on the unix listener.
        assert (await http_request(process.running.unix, "GET", "/readyz")).status == 503

        # The provider writes the id: ready without a restart.
        layout.sandbox_id_file.write_text(layout.sandbox_id + "\n")
        ready = await http_request(endpoint, "GET", "/readyz")
        assert ready.status == 200
        assert ready.json() == {"status": "ready", "checks": {"state": "ok", "keys": "ok", "sandboxId": "ok"}}
        async with process.running.client().connect():
            pass  # and an upgrade is admitted, as readiness said
    warnings = [e for e in process.log_events() if e["event"] == "supervisor.sandbox_id_missing"]
    assert len(warnings) == 1
    warning = warnings[0]
    assert warning["level"] == "warning"
    assert (warning["path"], warning["env_var"], warning["reason"]) == (
        str(layout.sandbox_id_file),
        SANDBOX_ID_ENV,
        "missing",
    )


async def test_with_a_sandbox_id_the_daemon_is_ready_and_does_not_warn(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        ready = await http_request(process.running.tcp, "GET", "/readyz")
        assert ready.status == 200
        assert ready.json()["status"] == "ready"
    assert not [e for e in process.log_events() if e["event"] == "supervisor.sandbox_id_missing"]


async def test_the_environment_fallback_makes_it_ready(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.sandbox_id_file.unlink()
    async with running_daemon(layout, env={SANDBOX_ID_ENV: layout.sandbox_id}) as process:
        assert (await http_request(process.running.tcp, "GET", "/readyz")).status == 200
    assert not [e for e in process.log_events() if e["event"] == "supervisor.sandbox_id_missing"]


async def test_an_unusable_id_is_named_and_a_draining_daemon_is_not_ready(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 4000})
    layout.sandbox_id_file.write_text("not an id!\n")
    async with running_daemon(layout) as process:
        body = (await http_request(process.running.tcp, "GET", "/readyz")).json()
        assert body["checks"]["sandboxId"] == "unusable"
        assert body["detail"]["sandboxId"] == f"{layout.sandbox_id_file} does not hold a valid sandbox id"
        layout.sandbox_id_file.write_text(layout.sandbox_id + "\n")
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            # A command that ignores SIGTERM keeps the daemon draining until the kill grace.
            stubborn = await session.call(
                "execute_shell_command", {"command": "trap '' TERM; echo up; sleep 30"}, idempotency_key="stubborn"
            )
            await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == stubborn)
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(READY_WAIT_S):
                while (ready := await http_request(process.running.tcp, "GET", "/readyz")).status == 200:
                    await trio.sleep(0.02)
            assert ready.status == 503
            assert ready.json()["checks"]["state"] == "draining"
            assert ready.json()["detail"]["state"] == "the daemon is draining"
        assert await process.wait(timeout=15) == 0


def test_readiness_is_a_route_of_its_own() -> None:
    paths = RoutePaths(control="/v1/control", health="/healthz", metrics=None, ready="/readyz")

    def head(path: str, *extra: tuple[bytes, bytes]) -> RequestHead:
        return RequestHead(method=b"GET", path=path, headers=[(b"host", b"x"), *extra])

    assert classify(head("/readyz"), paths) is Route.READY
    assert classify(head("/healthz"), paths) is Route.HEALTH
    # As for health: an upgrade asked of the readiness path is no probe.
    assert classify(head("/readyz", (b"upgrade", b"websocket")), paths) is Route.NOT_FOUND
    assert classify(head("/readyz"), RoutePaths(control="/v1/control", health="/healthz", metrics=None)) is Route.NOT_FOUND


def test_status_neither_logs_nor_fixes_the_id(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sandbox-id"
    identity = SandboxIdentity(path, env={})
    assert identity.status().problem == "missing"
    path.write_text("sbx-one\n")
    assert identity.status().value == "sbx-one"
    path.write_text("sbx-two\n")
    # Probes do not fix the id: the first upgrade's read does, and from then on it is cached.
    assert identity.status().value == "sbx-two"
    assert identity.read() == "sbx-two"
    os.unlink(path)
    assert identity.status().value == "sbx-two"
