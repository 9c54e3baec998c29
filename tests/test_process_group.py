"""The process-group lifecycle without a daemon: real shells, real groups, real signals."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ, read_oom_score_adj
from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec
from sandbox_supervisor.daemon.runtime.process_group import LingeringGroups, ProcessGroup
from sandbox_supervisor.daemon.runtime.processes import group_members, read_stat

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
DEADLINE_S = 10
POLL_S = 0.02
# A shell whose group ignores SIGTERM (an ignored disposition survives exec, so the
# background sleep ignores it too); it says when both are in place.
IGNORES_SIGTERM = "trap '' TERM; sleep 30 & echo ready; wait"


def spec(command: str, cwd: Path) -> HolderSpec:
    return HolderSpec(
        argv=("/bin/sh", "-c", command), cwd=str(cwd), env=ENV, stdin="null", oom_score_adj=COMMAND_OOM_SCORE_ADJ
    )


@asynccontextmanager
async def spawned(command: str, cwd: Path) -> AsyncIterator[ProcessGroup]:
    async with trio.open_nursery() as nursery:
        host = CommandHost()
        group = await ProcessGroup.hosted(host, "c1", cwd / "spool", spec(command, cwd))
        try:
            yield group
        finally:
            group.send_signal(signal.SIGKILL)
            with trio.move_on_after(DEADLINE_S):
                await group.wait()
            for pipe in group.pipes().values():
                await pipe.aclose()
            host.done("c1")
            await host.aclose()


async def read_line(group: ProcessGroup) -> bytes:
    data = b""
    with trio.fail_after(DEADLINE_S):
        while not data.endswith(b"\n"):
            data += await group.pipes()["stdout"].receive_some(1024)
    return data


async def wait_group_gone(pgid: int) -> None:
    with trio.fail_after(DEADLINE_S):
        while group_members(pgid):
            await trio.sleep(POLL_S)


async def test_spawn_leads_a_new_session_without_the_daemons_oom_protection(tmp_path):
    # What the command forks inherits the command's value, not the protected one.
    async with spawned("sh -c 'cat /proc/self/oom_score_adj'; echo started; sleep 30", tmp_path) as group:
        data = b""
        with trio.fail_after(DEADLINE_S):
            while not data.endswith(b"started\n"):
                data += await group.pipes()["stdout"].receive_some(1024)
        assert data == b"%d\nstarted\n" % COMMAND_OOM_SCORE_ADJ
        stat = read_stat(group.pid)
        assert stat is not None
        assert group.pgid == group.pid == stat.pgrp == stat.session
        # Set in the child before exec: the tracked pid is the command, with the value set.
        assert read_oom_score_adj(group.pid) == COMMAND_OOM_SCORE_ADJ
        assert stat.ppid != os.getpid()  # the host's child, not ours
        assert group.start_ticks() == stat.start_ticks
        assert group.alive() and group.returncode is None


async def test_spawn_refuses_an_unstartable_command_with_oserror(tmp_path):
    async with trio.open_nursery() as nursery:
        host = CommandHost()
        with pytest.raises(OSError) as raised:
            await ProcessGroup.hosted(host, "c1", tmp_path / "spool", spec("true", tmp_path / "missing"))
        assert raised.value.errno == errno.ENOENT and raised.value.stage == "cwd"  # type: ignore[attr-defined]
        await host.aclose()


async def test_wait_or_terminate_reports_an_exit_before_the_timeout(tmp_path):
    async with spawned("exit 7", tmp_path) as group:
        assert await group.wait_or_terminate(timeout_s=DEADLINE_S, grace_s=DEADLINE_S) == (7, False)


async def test_timeout_sigkills_a_group_ignoring_sigterm_after_the_grace(tmp_path):
    grace_s = 0.4
    async with spawned(IGNORES_SIGTERM, tmp_path) as group:
        assert await read_line(group) == b"ready\n"
        started = trio.current_time()
        returncode, timed_out = await group.wait_or_terminate(timeout_s=0.1, grace_s=grace_s)
        elapsed = trio.current_time() - started
        assert timed_out is True
        assert returncode == -signal.SIGKILL  # SIGTERM was ignored: only the SIGKILL ended it
        assert elapsed >= 0.1 + grace_s  # the whole grace was given before the SIGKILL
        await wait_group_gone(group.pgid)  # the background sleep too, not only the shell


async def test_terminate_ends_early_when_the_group_obeys_sigterm(tmp_path):
    async with spawned("sleep 30 & echo ready; wait", tmp_path) as group:
        assert await read_line(group) == b"ready\n"
        started = time.monotonic()
        await group.terminate(grace_s=30)
        # The group emptied on SIGTERM: no need to sit out the 30 s grace.
        assert time.monotonic() - started < DEADLINE_S
        assert await group.wait() == -signal.SIGTERM
        await wait_group_gone(group.pgid)


async def test_a_signal_reaches_a_background_child_of_the_group(tmp_path):
    marker = tmp_path / "child-got-int"
    # A background job starts with SIGINT ignored (and a shell cannot trap a signal ignored on
    # entry), so the child is Python, which may install a handler over that. It reports only
    # if the signal went to the whole group, not just to the shell at its head.
    child = (
        f"{sys.executable} -c \"import signal, sys, time; "
        f"signal.signal(signal.SIGINT, lambda *a: (open('{marker}', 'w').write('int'), sys.exit(0))); "
        "print('ready', flush=True); time.sleep(30)\""
    )
    async with spawned(f"trap 'exit 130' INT; {child} & wait", tmp_path) as group:
        assert await read_line(group) == b"ready\n"
        assert group.send_signal(signal.SIGINT) is True
        assert await group.wait() == 130
        with trio.fail_after(DEADLINE_S):
            while not marker.exists():
                await trio.sleep(POLL_S)
        await wait_group_gone(group.pgid)
        assert not group.alive()


async def test_abandon_kills_and_reaps_even_when_cancelled(tmp_path):
    async with spawned(IGNORES_SIGTERM, tmp_path) as group:
        assert await read_line(group) == b"ready\n"
        with trio.CancelScope() as scope:
            scope.cancel()
            await group.abandon()  # shielded: reaps although its caller is cancelled
        assert group.returncode == -signal.SIGKILL
        assert read_stat(group.pid) is None  # reaped: not even a zombie
        await wait_group_gone(group.pgid)


async def test_a_lingering_group_is_handed_back_once_it_is_empty(tmp_path):
    handed_back: list[tuple[int, bool]] = []
    async with trio.open_nursery() as nursery:
        lingering = LingeringGroups(nursery, poll_s=0.05)
        async with spawned("sleep 0.5 & exit 0", tmp_path) as group:
            assert await group.wait() == 0
            assert group.alive()  # the background sleep holds the group
            lingering.watch(group, lambda: handed_back.append((group.pgid, group.alive())))
            assert group in lingering
            with trio.fail_after(DEADLINE_S):
                while not handed_back:
                    await trio.sleep(POLL_S)
            # Handed back once, and only after its last process was gone.
            assert handed_back == [(group.pgid, False)]
            assert len(lingering) == 0 and group not in lingering


async def test_a_discarded_group_is_never_handed_back_and_the_sweeper_restarts(tmp_path):
    handed_back: list[str] = []
    async with trio.open_nursery() as nursery:
        lingering = LingeringGroups(nursery, poll_s=0.05)
        async with spawned("sleep 0.3 & exit 0", tmp_path) as first, spawned("sleep 0.3 & exit 0", tmp_path) as second:
            await first.wait()
            await second.wait()
            lingering.watch(first, lambda: handed_back.append("first"))
            lingering.discard(first)
            await wait_group_gone(first.pgid)
            # The sweeper ended with no group left; a new one starts it again.
            lingering.watch(second, lambda: handed_back.append("second"))
            with trio.fail_after(DEADLINE_S):
                while not handed_back:
                    await trio.sleep(POLL_S)
            assert handed_back == ["second"]

