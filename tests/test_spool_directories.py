"""Spool directories made ahead of need (supervisor/runtime/spool_directories.py), on real
directories: a call's spool directory is a ready one renamed into place, the worker makes
more between calls, a call whose directory exists keeps the refusal it had, a next start
takes what was left ready, and a file system that refuses leaves the calls to make their own."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest
import trio
import trio.testing

from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.runtime.spool import spool_dir
from sandbox_supervisor.daemon.runtime.spool_directories import (
    READY_DIRECTORY,
    READY_LOW,
    READY_TARGET,
    ReadySpoolDirectories,
)
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from shell_support import rig_settings, shell_call

DEADLINE_S = 10.0


async def _refilled(ready: ReadySpoolDirectories, count: int) -> None:
    with trio.fail_after(DEADLINE_S):
        while ready.ready < count:
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.001)  # the worker thread is not a trio task


async def test_a_calls_directory_is_a_ready_one_renamed_and_the_worker_makes_more(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        ready = ReadySpoolDirectories(tmp_path, nursery)
        first = str(uuid.uuid4())
        assert ready.take(first) is False  # none ready yet: the call makes its own
        await _refilled(ready, READY_TARGET)
        names = sorted(os.listdir(tmp_path / READY_DIRECTORY))
        assert len(names) == READY_TARGET
        inodes = {os.stat(tmp_path / READY_DIRECTORY / name).st_ino for name in names}
        second = str(uuid.uuid4())
        assert ready.take(second) is True
        made = os.stat(spool_dir(tmp_path, second))
        assert made.st_ino in inodes  # renamed, not made
        assert stat.S_IMODE(made.st_mode) == 0o700 and os.listdir(spool_dir(tmp_path, second)) == []
        assert ready.ready == READY_TARGET - 1
        for _ in range(READY_TARGET - READY_LOW):  # down to the low mark: a refill starts
            ready.take(str(uuid.uuid4()))
        await _refilled(ready, READY_TARGET)


async def test_a_call_whose_directory_holds_files_keeps_it_and_the_ready_one_stays(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        ready = ReadySpoolDirectories(tmp_path, nursery)
        ready.take(str(uuid.uuid4()))
        await _refilled(ready, READY_TARGET)
        reused = str(uuid.uuid4())
        spool_dir(tmp_path, reused).mkdir()
        (spool_dir(tmp_path, reused) / "stdout").write_bytes(b"the first run's output")
        assert ready.take(reused) is False
        assert (spool_dir(tmp_path, reused) / "stdout").read_bytes() == b"the first run's output"
        assert ready.ready == READY_TARGET


async def test_a_file_at_the_calls_path_keeps_the_ready_ones_ready(tmp_path: Path) -> None:
    """Only tampering puts a file at spool/<call_id>; the rename then fails with ENOTDIR, and
    that must not use up (and lose) every ready directory in turn."""
    async with trio.open_nursery() as nursery:
        ready = ReadySpoolDirectories(tmp_path, nursery)
        ready.take(str(uuid.uuid4()))
        await _refilled(ready, READY_TARGET)
        blocked = str(uuid.uuid4())
        spool_dir(tmp_path, blocked).write_text("not a directory")
        assert ready.take(blocked) is False
        assert ready.ready == READY_TARGET
        assert len(os.listdir(tmp_path / READY_DIRECTORY)) == READY_TARGET
        nursery.cancel_scope.cancel()


async def test_a_next_start_takes_the_empty_ones_left_ready_and_leaves_anything_else(tmp_path: Path) -> None:
    left = tmp_path / READY_DIRECTORY
    left.mkdir(parents=True)
    (left / "empty").mkdir()
    (left / "not-empty").mkdir()
    (left / "not-empty" / "x").write_text("?")
    (left / "a-file").write_text("?")
    (tmp_path / "spool").mkdir()
    async with trio.open_nursery() as nursery:
        ready = ReadySpoolDirectories(tmp_path, nursery)
        assert ready.ready == 1
        call_id = str(uuid.uuid4())
        assert ready.take(call_id) is True
        assert not (left / "empty").exists() and spool_dir(tmp_path, call_id).is_dir()
        nursery.cancel_scope.cancel()
    assert (left / "not-empty" / "x").exists() and (left / "a-file").exists()


async def test_a_refusing_file_system_leaves_the_calls_to_make_their_own(tmp_path: Path) -> None:
    """`spool-ready` cannot be made (a file is in the way): no directory is ever ready, and
    commands still run, each making its spool directory itself."""
    state_dir = tmp_path / "state"
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with StateStore.open(state_dir) as store:
        (state_dir / READY_DIRECTORY).write_text("in the way")
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                shell = ShellRuntime(rig_settings(state_dir), store, Journal(store), nursery)
                for _ in range(3):
                    running = shell_call(workspace, "echo spooled")
                    result = await shell.execute(running)
                    assert result["exit_code"] == 0
                    assert (spool_dir(state_dir, running.call.call_id) / "stdout").read_bytes() == b"spooled\n"
                    await trio.testing.wait_all_tasks_blocked()
                assert shell.ready_spools.ready == 0
                while shell.commands:  # every command's tasks end on their own
                    await trio.sleep(0.01)
                await shell.host.aclose()


async def test_writers_in_a_renamed_directory_skip_its_checks_and_still_spool(tmp_path: Path, monkeypatch) -> None:
    """A ready directory renamed into place is empty by construction: its writers make no
    directory and look for no stream file (a failing mkdir and two stats per command), and
    the bytes still land in it. A directory the writers must make is checked as before."""
    from sandbox_supervisor.daemon.runtime.command_output import CommandOutput, OutputLimits
    from sandbox_supervisor.daemon.runtime.spool import SpoolWriter

    limits = OutputLimits(throttle_ms=50, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1 << 20)
    checked: list[Path] = []
    real_mkdir, real_exists = Path.mkdir, Path.exists

    def counting_mkdir(self: Path, *args: object, **kwargs: object) -> None:
        checked.append(self)
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_exists(self: Path, *args: object, **kwargs: object) -> bool:
        checked.append(self)
        return real_exists(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", counting_mkdir)
    monkeypatch.setattr(Path, "exists", counting_exists)
    with StateStore.open(tmp_path / "state") as store:
        async with trio.open_nursery() as nursery:
            ready = ReadySpoolDirectories(tmp_path, nursery)
            ready.take(str(uuid.uuid4()))
            await _refilled(ready, READY_TARGET)
            checked.clear()
            call_id = str(uuid.uuid4())
            output = CommandOutput.open(tmp_path, call_id, limits, Journal(store), ready=ready)
            assert checked == []
            output.streams["stdout"].feed(b"kept\n")
            output.close()
            assert (spool_dir(tmp_path, call_id) / "stdout").read_bytes() == b"kept\n"
            nursery.cancel_scope.cancel()
    # Without a ready directory the writer makes it, and refuses a stream that is there.
    made = spool_dir(tmp_path, str(uuid.uuid4()))
    SpoolWriter(made / "stdout", 1024).close()
    assert made.is_dir() and made in checked
    (made / "stderr").write_bytes(b"")
    with pytest.raises(FileExistsError):
        SpoolWriter(made / "stderr", 1024)
