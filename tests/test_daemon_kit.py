"""testing/daemon.py's `running_daemon`: a real subprocess daemon that is always stopped.

Public API for users' own tests, so its promises are tested here: stopped on leaving whether
the body returns, raises or is cancelled; killed when SIGTERM does not end it in time (and
then the body's exception, if any, is the one raised); a daemon that exits before listening
is a typed error carrying its exit status and log.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

from sandbox_supervisor.testing.daemon import DaemonExitedEarly, DaemonStopTimeout, make_layout, running_daemon

# The command ignores SIGTERM, so a stopping daemon waits out the kill grace before it exits;
# a stop timeout far below that grace makes the stop time out for sure.
KILL_GRACE_MS = 20_000
SHORT_STOP_TIMEOUT_S = 0.5


class BodyFailed(Exception):
    pass


async def _start_stubborn_command(process) -> int:
    """Run a command that ignores SIGTERM; return its process group."""
    async with process.running.client().connect() as session:
        await session.bootstrap(cwd=str(process.layout.workspace))
        await session.call("execute_shell_command", {"command": "trap '' TERM; echo up; sleep 60"}, idempotency_key="s")
        started = await session.receive_until(lambda f: f["kind"] == "exec.started")
        await session.receive_until(lambda f: f["kind"] == "exec.output")
        return int(started["body"]["pgid"])


def _kill_group(pgid: int) -> None:
    # The daemon was SIGKILLed: nothing ended its command's group, so the test does.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def test_leaving_stops_the_daemon_with_sigterm(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        assert process.returncode is None
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
    assert process.returncode == 0  # a clean SIGTERM exit, which also removes the socket
    assert not layout.unix_socket.exists()


async def test_a_body_that_raises_still_stops_the_daemon(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    with pytest.raises(BodyFailed):
        async with running_daemon(layout) as process:
            raise BodyFailed()
    assert process.returncode == 0


async def test_a_cancelled_body_still_stops_the_daemon(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    with trio.CancelScope() as scope:
        async with running_daemon(layout) as process:
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert process.returncode == 0  # stopped under a shield, not abandoned by the cancel


async def test_a_stop_that_times_out_kills_and_raises(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": KILL_GRACE_MS})
    pgid = None
    try:
        with pytest.raises(DaemonStopTimeout):
            async with running_daemon(layout, stop_timeout=SHORT_STOP_TIMEOUT_S) as process:
                pgid = await _start_stubborn_command(process)
        assert process.returncode == -signal.SIGKILL
    finally:
        if pgid is not None:
            _kill_group(pgid)


async def test_a_stop_that_times_out_after_a_failing_body_raises_the_bodys_exception(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": KILL_GRACE_MS})
    pgid = None
    try:
        with pytest.raises(BodyFailed):
            async with running_daemon(layout, stop_timeout=SHORT_STOP_TIMEOUT_S) as process:
                pgid = await _start_stubborn_command(process)
                raise BodyFailed()
        assert process.returncode == -signal.SIGKILL
    finally:
        if pgid is not None:
            _kill_group(pgid)


async def test_a_daemon_that_exits_before_listening_is_a_typed_error(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.jwks_file.write_text(json.dumps({"keys": [authority.signing_jwk()]}))  # a private key: exit 2
    with pytest.raises(DaemonExitedEarly) as exited:
        async with running_daemon(layout):
            raise AssertionError("the body must not run")
    assert exited.value.returncode == 2
    assert "jwks" in exited.value.log.lower()
    assert isinstance(exited.value, RuntimeError)  # what callers of start() caught before


async def test_without_wait_ready_the_body_gets_the_process_at_once(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, listen={"tcp": [], "unix": []})  # exits 2
    async with running_daemon(layout, wait_ready=False) as process:
        with pytest.raises(RuntimeError, match="wait_ready"):
            process.running
        assert await process.wait(timeout=15) == 2
    assert process.returncode == 2
