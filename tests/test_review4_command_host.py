"""Findings of an independent review of the command host, each a reproduction that failed
before its fix. Real daemons, real command hosts, real kill -9s."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import trio

from sandbox_supervisor.daemon.runtime.processes import read_stat
from sandbox_supervisor.daemon.runtime.recovery import is_command_host
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

from tests.test_command_host import DEADLINE_S, kill_daemon, start_again, started_command, wait_gone


# A stop ends running commands within exec.kill_grace_ms (2 s) and the stop's own budget.
STOP_ENDS_COMMANDS_S = 6


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


async def test_review4_a_host_killed_while_idle_does_not_fail_the_next_command(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            marker = layout.workspace / "go"
            command = f"echo before; while [ ! -e {marker} ]; do sleep 0.02; done"
            call_id, pid = await started_command(session, client, command, "first")
            host = read_stat(pid).ppid
            assert is_command_host(host)
            marker.touch()
            assert (await session.result(call_id, timeout=DEADLINE_S))["ok"] is True
            # No command runs: the host waits idle. It dies (OOM killer, an operator's kill).
            os.kill(host, signal.SIGKILL)
            await wait_gone(host)
            again = await session.call("execute_shell_command", {"command": "echo fine"}, idempotency_key="next")
            result = await session.result(again, timeout=DEADLINE_S)
    assert result["ok"] is True, result["error"]
    assert result["result"]["stdout"]["head"] == "fine\n"


async def test_review4_exec_signal_reaches_an_adopted_command(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    pid = 0
    try:
        async with running_daemon(layout) as process:
            client = process.running.client()
            cwd = str(layout.workspace)
            async with client.connect() as session:
                await session.bootstrap(cwd=cwd)
                call_id, pid = await started_command(session, client, "echo before; sleep 30", "adopted")
            await kill_daemon(process)
            await start_again(process, client)
            async with client.connect() as session:
                await session.bootstrap(cwd=cwd)
                assert read_stat(pid) is not None  # adopted, not killed
                await session.send("exec.signal", {"call_id": call_id, "signal": "SIGTERM"})
                answer = await session.receive_until(
                    lambda f: f["body"].get("call_id") == call_id and f["kind"] in ("error", "tool.result"),
                    timeout=DEADLINE_S,
                )
        assert answer["kind"] == "tool.result", answer
        assert answer["body"]["result"]["signal"] == "SIGTERM"
    finally:
        if pid:
            _kill_group(pid)


async def test_review4_a_stop_ends_an_adopted_command(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    pid = 0
    try:
        async with running_daemon(layout) as process:
            client = process.running.client()
            cwd = str(layout.workspace)
            async with client.connect() as session:
                await session.bootstrap(cwd=cwd)
                _call_id, pid = await started_command(session, client, "echo before; sleep 30", "adopted")
            await kill_daemon(process)
            await start_again(process, client)
            assert read_stat(pid) is not None  # adopted, not killed
            await process.stop()
        # The stop's SIGTERM, SIGKILL after kill_grace_ms (2 s), is long over by then.
        with trio.fail_after(STOP_ENDS_COMMANDS_S):
            while (stat := read_stat(pid)) is not None and stat.state != "Z":
                await trio.sleep(0.02)
    finally:
        if pid:
            _kill_group(pid)


async def test_review4_the_host_never_appends_after_a_gap_in_the_spool(tmp_path, authority):
    from tests.test_exhaustion import small_tmpfs

    from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE
    from sandbox_supervisor.daemon.runtime.spool import spool_dir, stream_path

    from tests.test_command_host import wait_file

    layout = make_layout(tmp_path / "d", authority=authority)
    spool = layout.state_dir / "spool"
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = layout.workspace / "go"
    produced = b"a" * 100_000 + b"\nbefore\n"
    command = f"head -c 100000 /dev/zero | tr '\\0' a; echo; echo before; while [ ! -e {marker} ]; do sleep 0.02; done; echo AFTER"
    with small_tmpfs(spool):
        # Half the small disk taken: the command's stdout fills the rest, and its writer drops.
        filler = spool / "filler"
        filler.write_bytes(b"\0" * (32 * 1024))
        async with running_daemon(layout) as process:
            client = process.running.client()
            async with client.connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                call_id, _pid = await started_command(session, client, command, "gap")
            filler.unlink()  # space is back
            await kill_daemon(process)
            marker.touch()  # the command prints on while no daemon runs; its host spools it
            await wait_file(spool_dir(layout.state_dir, call_id) / EXIT_FILE)
            kept = stream_path(layout.state_dir, call_id, "stdout").read_bytes()
    assert len(kept) < len(produced)  # the disk was full: some was dropped
    # What the spool keeps is the stream's first bytes, never later ones after a gap.
    assert (produced + b"AFTER\n").startswith(kept), kept[-20:]


async def test_review4_a_prune_keeps_the_spool_of_an_adopted_command(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"spool_total_max_bytes": 1000})
    marker = layout.workspace / "go"
    command = f"while [ ! -e {marker} ]; do sleep 0.02; done; echo after; exit 5"
    async with running_daemon(layout) as process:
        client = process.running.client()
        cwd = str(layout.workspace)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            call_id = await session.call("execute_shell_command", {"command": command}, idempotency_key="quiet")
            await session.receive_until(
                lambda f: f["kind"] == "exec.started" and f["body"]["call_id"] == call_id, timeout=DEADLINE_S
            )
        await kill_daemon(process)
        await start_again(process, client)
        async with client.connect() as session:
            await session.bootstrap(cwd=cwd)
            # Another command passes the spool cap: the oldest finished spools are pruned.
            big = await session.call("execute_shell_command", {"command": "head -c 5000 /dev/zero"}, idempotency_key="big")
            assert (await session.result(big, timeout=DEADLINE_S))["ok"] is True
            with trio.fail_after(DEADLINE_S):
                while (layout.state_dir / "spool" / big).exists():
                    await trio.sleep(0.02)
            marker.touch()
            result = await session.result(call_id, timeout=DEADLINE_S)
    assert result["ok"] is True, result["error"]
    assert result["result"]["exit_code"] == 5 and result["result"]["stdout"]["head"] == "after\n"


# net.core.wmem_max on a stock kernel: SO_SNDBUF requests are capped at it (and doubled).
STOCK_WMEM_MAX = 212992


async def test_review4_a_large_spawn_does_not_kill_the_running_commands(tmp_path, authority, monkeypatch):
    import socket as stdlib_socket
    import types

    from sandbox_supervisor.daemon.runtime import command_host_link
    from sandbox_supervisor.testing.daemon import in_process_daemon

    def socketpair(family, kind):
        # The send buffer a stock kernel gives for a request of MAX_MESSAGE_BYTES; the link's
        # own SO_SNDBUF request is turned into a second SO_RCVBUF one (shim below).
        a, b = stdlib_socket.socketpair(family, kind)
        for end in (a, b):
            end.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, STOCK_WMEM_MAX)
        return a, b

    shim = types.SimpleNamespace(**{k: getattr(stdlib_socket, k) for k in dir(stdlib_socket) if not k.startswith("__")})
    shim.socketpair = socketpair
    shim.SO_SNDBUF = stdlib_socket.SO_RCVBUF
    monkeypatch.setattr(command_host_link, "socket", shim)
    monkeypatch.setattr(command_host_link, "SPAWN_TIMEOUT_S", 2.0)

    layout = make_layout(tmp_path / "d", authority=authority, websocket={"max_message_bytes": 1024 * 1024})
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            running, pid = await started_command(session, client, "echo before; sleep 30", "running")
            try:
                # 500,000 bytes of environment: under MAX_MESSAGE_BYTES, over the send buffer.
                big = await session.call(
                    "execute_shell_command", {"command": "true", "env": {"BIG": "x" * 500_000}}, idempotency_key="big"
                )
                await session.result(big, timeout=DEADLINE_S)
                assert read_stat(pid) is not None and read_stat(pid).state != "Z"
                await session.send("exec.signal", {"call_id": running, "signal": "SIGTERM"})
                result = await session.result(running, timeout=DEADLINE_S)
            finally:
                _kill_group(pid)
    assert result["ok"] is True, result["error"]
    assert result["result"]["signal"] == "SIGTERM"
