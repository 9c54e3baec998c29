"""A real kill -9 in the middle of `apply_file_patch`'s write: the temp file it leaves in the
agent's workspace is removed at the next start, and the file is the old or the new one,
never torn (docs/operations.md, "Faults and what the daemon does").

The daemon is caught, not slowed: the test polls the workspace for the temp file, stops the
daemon with SIGSTOP as soon as it appears (every thread seen stopped in /proc), checks the
temp file is still there, and only then sends SIGKILL, so the kill lands between the temp
file's creation and its rename. If the rename won the race, the daemon is continued and the
next patch is tried.

Every patch is keyed (the protocol requires `idempotency_key` for `apply_file_patch`): its
pending record, written before the tool runs, is how the next start finds the file, so no
other trace of the write is needed. The second test pins that requirement.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import trio

from sandbox_supervisor.daemon.runtime.patch import TEMP_SUFFIX
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

# Large enough that writing and fsyncing the temp file takes milliseconds, which the poll
# below sees; small enough to stay quick (the file is hashed, patched and written each time).
BIG_FILE_LINES = 400_000
LINE = b"0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz\n"
# Patches tried until one is caught with its temp file on disk (the first, almost always).
ATTEMPTS = 5
CATCH_TIMEOUT_S = 20.0
KILL_TIMEOUT_S = 5.0


def _sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _temps(directory: Path) -> list[Path]:
    return [directory / name for name in os.listdir(directory) if name.endswith(TEMP_SUFFIX)]


def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (state T): nothing of it runs any more."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t"):
            return False
    return True


def _catch_temp(pid: int, directory: Path, deadline: float) -> Path | None:
    """Poll for a temp file; when one appears, SIGSTOP the daemon and wait until it is
    stopped. The temp file if it still exists then (the daemon stays stopped); else the
    daemon is continued and None returned (the rename came first, or none appeared)."""
    while time.monotonic() < deadline:
        found = _temps(directory)
        if not found:
            continue
        os.kill(pid, signal.SIGSTOP)
        while not _stopped(pid):
            if time.monotonic() > deadline:
                raise AssertionError("the daemon did not stop")
        if found[0].exists():
            return found[0]
        os.kill(pid, signal.SIGCONT)
        return None
    return None


async def test_a_kill_during_a_patch_write_leaves_no_temp_file_and_no_torn_file(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    workspace = layout.workspace
    target = workspace / "big.txt"
    content = LINE * BIG_FILE_LINES
    target.write_bytes(content)
    versions = {_sha(content)}  # what the file may hold after the restart
    async with running_daemon(layout) as process:
        assert process.proc is not None
        pid = process.proc.pid
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(workspace))
            caught = None
            for attempt in range(ATTEMPTS):
                old_first, rest = content.split(b"\n", 1)
                new_first = b"edit %d" % attempt
                diff = "--- a/big.txt\n+++ b/big.txt\n@@ -1 +1 @@\n-%s\n+%s\n" % (old_first.decode(), new_first.decode())
                new = new_first + b"\n" + rest
                versions.add(_sha(new))
                call_id = await session.call(
                    "apply_file_patch",
                    {"path": "big.txt", "diff": diff, "base_sha": _sha(content)},
                    idempotency_key=f"patch-{attempt}",
                )
                deadline = time.monotonic() + CATCH_TIMEOUT_S
                caught = await trio.to_thread.run_sync(_catch_temp, pid, workspace, deadline)
                if caught is not None:
                    break
                result = await session.result(call_id, timeout=CATCH_TIMEOUT_S)
                assert result["ok"] is True, result.get("error")
                content = new
            assert caught is not None, f"no patch was caught writing in {ATTEMPTS} attempts"
            os.kill(pid, signal.SIGKILL)  # while stopped: between the temp's creation and its rename
            await process.wait(KILL_TIMEOUT_S)
    assert caught.exists()  # what the fault leaves: the agent's `git status` shows it

    async with running_daemon(layout) as process:
        events = process.log_events()
    assert _temps(workspace) == []
    assert _sha(target.read_bytes()) in versions  # old or new, never torn
    removed = [e for e in events if e["event"] == "recovery.leftovers_removed" and e["where"] == "workspace"]
    assert [e["files"] for e in removed] == [1], removed


async def test_a_patch_without_an_idempotency_key_is_refused(tmp_path, authority):
    """Why the pending record is enough to find every patch's temp file: no patch runs
    without one. Refused before anything is written."""
    layout = make_layout(tmp_path / "d", authority=authority)
    (layout.workspace / "a.txt").write_bytes(b"old\n")
    async with running_daemon(layout) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            call_id = await session.call(
                "apply_file_patch",
                {"path": "a.txt", "diff": "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-old\n+new\n", "base_sha": _sha(b"old\n")},
            )
            result = await session.result(call_id)
    assert result["ok"] is False and result["error"]["code"] == "invalid_parameters", result
    assert "idempotency_key" in result["error"]["message"]
    assert (layout.workspace / "a.txt").read_bytes() == b"old\n"
    assert _temps(layout.workspace) == []
