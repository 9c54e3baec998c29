"""The holders' fork server (runtime/holder_forkserver.py) and its trio side
(runtime/holder_starter.py): holders started by one warm interpreter, as detached as the ones
`launch_holder` starts. Real processes, real fork server."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.runtime.holder_launch import HolderLaunchError
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec, read_exit
from sandbox_supervisor.daemon.runtime.holder_starter import HolderStarter
from sandbox_supervisor.daemon.runtime.processes import read_stat

PATH = "/usr/local/bin:/usr/bin:/bin"
DEADLINE_S = 10


def sh(script: str, **fields: object) -> HolderSpec:
    return HolderSpec(argv=("/bin/sh", "-c", script), cwd="/", env={"PATH": PATH}, kill_grace_s=1.0, **fields)  # type: ignore[arg-type]


async def wait_until(predicate, what: str) -> None:
    with trio.fail_after(DEADLINE_S):
        while not predicate():
            await trio.sleep(0.01)


def alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


@pytest.fixture
async def starter():
    holders = HolderStarter()
    pids: list[int] = []
    holders.started = pids  # type: ignore[attr-defined]
    try:
        yield holders
    finally:
        await holders.aclose()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


async def test_a_holder_from_the_fork_server_runs_its_process_and_outlives_the_server(starter, tmp_path):
    info = await starter.launch(tmp_path / "a", sh("echo hi; sleep 30", stdin="null"))
    starter.started.append(info.pgid)
    # Not the daemon's child: the server's (one fork per holder), until the server ends.
    holder = read_stat(info.holder_pid)
    assert holder is not None and holder.ppid == starter._process.pid != os.getpid()
    assert read_stat(info.holder_pid).session != os.getsid(0)  # out of the daemon's session
    await wait_until(lambda: (tmp_path / "a" / "stdout").exists() and (tmp_path / "a" / "stdout").read_text() == "hi\n", "the output")
    await starter.aclose()  # the server ends (as when the daemon dies): the holder does not
    assert alive(info.holder_pid) and alive(info.pid)
    assert read_stat(info.holder_pid).ppid != os.getpid()  # reparented, and still not ours
    os.killpg(info.pgid, signal.SIGTERM)
    await wait_until(lambda: (tmp_path / "a" / "exit.json").exists(), "the exit record")
    assert read_exit(tmp_path / "a").signal == "SIGTERM"


async def test_many_holders_come_from_one_warm_server(starter, tmp_path):
    """The point of the server: no interpreter start per holder."""
    await starter.launch(tmp_path / "w0", sh("true", stdin="null"))
    server = starter._process.pid
    for i in range(1, 6):
        await starter.launch(tmp_path / f"w{i}", sh("true", stdin="null"))
    assert starter._process.pid == server  # one server for all
    for i in range(6):
        await wait_until(lambda i=i: (tmp_path / f"w{i}" / "exit.json").exists(), "each exit record")
        assert read_exit(tmp_path / f"w{i}").exit_code == 0
    # The kernel reaps the server's ended holders (it ignores SIGCHLD): no zombie piles up.
    await wait_until(lambda: not zombie_children(server), "the ended holders reaped")


def children(parent: int) -> list[int]:
    """The live (non-zombie) processes whose parent is `parent`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None and stat.ppid == parent and stat.state != "Z":
                found.append(stat.pid)
    return found


def zombie_children(parent: int) -> list[int]:
    zombies = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None and stat.ppid == parent and stat.state == "Z":
                zombies.append(stat.pid)
    return zombies


async def test_a_forked_holder_has_only_the_standard_library_loaded(starter, tmp_path):
    """It is a fork of the server, so it has what the server imported: that must stay the
    holder's own (no pydantic, trio or structlog), as for a holder started alone."""
    import socket

    from sandbox_supervisor.daemon.runtime.holder_protocol import CONTROL_SOCKET, encode_modules

    info = await starter.launch(tmp_path / "m", sh("sleep 30", stdin="null"))
    starter.started.append(info.pgid)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(DEADLINE_S)
        conn.connect(str(tmp_path / "m" / CONTROL_SOCKET))
        conn.sendall(encode_modules())
        reply = b""
        while not reply.endswith(b"\n"):
            reply += conn.recv(65536)
    import json

    modules = json.loads(reply)["modules"]
    assert "sandbox_supervisor.daemon.runtime.holder" in modules
    assert not [m for m in modules if m.split(".")[0] in ("pydantic", "trio", "structlog", "pydantic_core")]


async def spare_of(starter: HolderStarter, holders: set[int]) -> int:
    """The server's one child that is no started holder: the spare, forked after its
    last answer (waited for: the fork follows the answer)."""
    server = starter._process.pid
    found: list[int] = []

    def one_spare() -> bool:
        found[:] = [pid for pid in children(server) if pid not in holders]
        return len(found) == 1

    await wait_until(one_spare, "one spare holder")
    return found[0]


async def test_the_next_holder_is_forked_before_its_request(starter, tmp_path):
    """A start hands its directory to a holder the server forked after the previous answer:
    the holder of the second start was already running, in a session of its own, before
    the request for it was written."""
    first = await starter.launch(tmp_path / "s0", sh("sleep 30", stdin="null"))
    starter.started.append(first.pgid)
    spare = await spare_of(starter, {first.holder_pid})
    waiting = read_stat(spare)
    assert waiting is not None and waiting.session == spare != os.getsid(0)
    second = await starter.launch(tmp_path / "s1", sh("echo second", stdin="null"))
    assert second.holder_pid == spare
    await wait_until(lambda: (tmp_path / "s1" / "exit.json").exists(), "the exit record")
    assert (tmp_path / "s1" / "stdout").read_text() == "second\n"
    assert read_exit(tmp_path / "s1").exit_code == 0
    # And another spare waits for the next start.
    assert await spare_of(starter, {first.holder_pid, spare}) != spare


async def test_a_spare_that_died_is_replaced_and_the_start_goes_on(starter, tmp_path):
    first = await starter.launch(tmp_path / "k0", sh("true", stdin="null"))
    spare = await spare_of(starter, {first.holder_pid})
    os.kill(spare, signal.SIGKILL)
    await wait_until(lambda: not alive(spare), "the spare's death")
    info = await starter.launch(tmp_path / "k1", sh("echo on", stdin="null"))
    assert info.holder_pid != spare
    await wait_until(lambda: (tmp_path / "k1" / "exit.json").exists(), "the exit record")
    assert (tmp_path / "k1" / "stdout").read_text() == "on\n"


async def test_the_spare_ends_with_the_server_and_starts_nothing(starter, tmp_path):
    """A daemon that dies closes the server's stdin; the server ends, and so does the
    holder it had forked ahead, without a process or a file of its own."""
    first = await starter.launch(tmp_path / "e0", sh("true", stdin="null"))
    spare = await spare_of(starter, {first.holder_pid})
    assert children(spare) == []  # waiting: it has started nothing
    await starter.aclose()
    await wait_until(lambda: not alive(spare), "the spare's end")


def test_a_forked_holder_starts_its_process_by_the_spawner_not_a_python_child(tmp_path, monkeypatch):
    """The fork server's holders start their process as the command host does
    (spawner.Spawner: Popen), not by holder.spawn's fork running Python code. Run in this
    process, where holder.spawn can be made to refuse: a holder that called it would report
    `spawn_failed`."""
    from sandbox_supervisor.daemon.runtime import holder, holder_forkserver
    from sandbox_supervisor.daemon.runtime.holder_launch import write_spec
    from sandbox_supervisor.daemon.runtime.holder_protocol import read_holder
    from sandbox_supervisor.daemon.runtime.spawner import Spawner

    def refuse(spec, stdio):
        raise holder.SpawnError("exec", errno.EPERM)

    monkeypatch.setattr(holder, "spawn", refuse)
    directory = tmp_path / "p"
    write_spec(directory, sh("echo popen", stdin="null"))
    assert holder_forkserver.start_one(directory, None, Spawner()) == 0
    info = read_holder(directory)
    assert info is not None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (directory / "exit.json").exists():
            assert time.monotonic() < deadline, "no exit record"
            time.sleep(0.01)
        assert (directory / "stdout").read_text() == "popen\n"
        assert read_exit(directory).exit_code == 0
    finally:
        os.waitpid(info.holder_pid, 0)  # this process's child: the server would have ignored SIGCHLD


async def test_a_dead_fork_server_is_replaced_at_the_next_launch(starter, tmp_path):
    await starter.launch(tmp_path / "b0", sh("true", stdin="null"))
    old = starter._process.pid
    os.kill(old, signal.SIGKILL)
    await wait_until(lambda: not alive(old), "the server's death")
    info = await starter.launch(tmp_path / "b1", sh("echo again", stdin="null"))
    assert starter._process.pid != old
    await wait_until(lambda: (tmp_path / "b1" / "exit.json").exists(), "the exit record")
    assert read_exit(tmp_path / "b1").exit_code == 0 and info.pid > 0


async def test_a_spawn_that_fails_is_a_typed_error_and_the_server_stays(starter, tmp_path):
    with pytest.raises(HolderLaunchError) as failed:
        await starter.launch(tmp_path / "c0", HolderSpec(argv=("/bin/true",), cwd="/no/such/dir", env={}, stdin="null"))
    assert failed.value.code == "spawn_failed"
    server = starter._process.pid
    with pytest.raises(HolderLaunchError) as again:
        await starter.launch(tmp_path / "c0", sh("true", stdin="null"))  # the directory is used
    assert again.value.code == "holder_exists"
    await starter.launch(tmp_path / "c1", sh("true", stdin="null"))
    assert starter._process.pid == server


async def test_a_server_that_does_not_answer_is_killed_at_the_deadline(tmp_path):
    holders = HolderStarter(timeout_s=0.5)
    try:
        await holders.launch(tmp_path / "d0", sh("true", stdin="null"))
        server = holders._process.pid
        os.kill(server, signal.SIGSTOP)  # wedged
        with pytest.raises(HolderLaunchError) as failed:
            await holders.launch(tmp_path / "d1", sh("true", stdin="null"))
        assert failed.value.code == "holder_timeout"
        await wait_until(lambda: not alive(server), "the wedged server's end")
    finally:
        await holders.aclose()


def test_a_daemon_that_dies_before_the_answer_ends_the_server_quietly(tmp_path):
    """The daemon's end of the answers closes while a start is under way: the server cannot
    answer, ends without a traceback, and the holder it started runs on."""
    import subprocess
    import sys

    from sandbox_supervisor.daemon.runtime.holder_forkserver import __name__ as module
    from sandbox_supervisor.daemon.runtime.holder_launch import write_spec
    from sandbox_supervisor.daemon.runtime.holder_protocol import read_holder

    directory = tmp_path / "gone"
    write_spec(directory, sh("sleep 30", stdin="null"))
    server = subprocess.Popen(
        [sys.executable, "-I", "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    info = None
    try:
        server.stdin.write(os.fsencode(directory) + b"\n")
        server.stdin.flush()
        server.stdout.close()  # the daemon is gone before the answer
        deadline = time.monotonic() + DEADLINE_S
        while (info := read_holder(directory)) is None:
            assert time.monotonic() < deadline, "no holder.json"
            time.sleep(0.01)
        server.stdin.close()
        assert server.wait(timeout=DEADLINE_S) == 0
        assert server.stderr.read() == b""
        assert alive(info.holder_pid) and alive(info.pid)
    finally:
        server.kill()
        server.wait()
        if info is not None:
            os.killpg(info.pgid, signal.SIGKILL)


def test_a_spares_warm_up_runs_clean_and_leaves_nothing_behind():
    """The spare runs a holder's start on nothing before its request (holder.warm_up): it
    must neither fail (warm_up would hide it, and the start would pay the faults again) nor
    leave a descriptor, a file or a socket behind."""
    from sandbox_supervisor.daemon.runtime import holder

    fds_before = sorted(os.listdir("/proc/self/fd"))
    root_before = sorted(os.listdir("/"))
    holder._warm_up_steps()
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert sorted(os.listdir("/")) == root_before
