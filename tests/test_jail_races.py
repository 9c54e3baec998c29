"""Races against the jail through a real daemon (docs/protocol.md §7.2): a second process
keeps swapping a workspace component for a symlink to outside while read_file and
apply_file_patch run. The daemon runs as root here, as in production; whatever the swap's
timing, nothing outside the workspace may be read or written.

The swapper is a separate process (a thread would share the daemon's GIL and swap far less
often). It runs until the test creates its stop file, bounded by its own deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.runtime.patch import git_blob_sha
from sandbox_supervisor.testing.daemon import in_process_daemon

ZERO = "0" * 40
SECRET = "outside secret\n"
INSIDE = "inside\n"
READS = 300
PATCHES = 150
# How long a swapper may run at most, should the test die before it stops it.
SWAPPER_DEADLINE_S = 60.0
STOP_WAIT_S = 10.0
SWAPS_BEFORE_START = 50

SWAPPER = textwrap.dedent(
    """
    import ctypes, os, sys, time
    mode, path, target, hidden, stop, counter = sys.argv[1:7]
    deadline = time.monotonic() + float(sys.argv[7])
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    exchange = getattr(libc, "renameat2", None)
    os.symlink(target, hidden)
    swaps = 0
    while not os.path.exists(stop) and time.monotonic() < deadline:
        # `path` is, in turn, what it was (a file or a directory) and a symlink to outside.
        if exchange is not None and exchange(AT_FDCWD, path.encode(), AT_FDCWD, hidden.encode(), RENAME_EXCHANGE) == 0:
            pass  # one atomic step: the name is never missing
        else:
            aside = path + ".aside"
            os.rename(path, aside)
            os.rename(hidden, path)
            os.rename(aside, hidden)
        swaps += 1
        if swaps == %d:
            open(counter, "w").close()  # the race is on
    if os.path.islink(path):
        os.rename(hidden, path + ".aside")
        os.rename(path, hidden)
        os.rename(path + ".aside", path)
    os.unlink(hidden)
    with open(counter, "w") as f:
        f.write(str(swaps))
    """
    % SWAPS_BEFORE_START
)


class Swapper:
    def __init__(self, tmp: Path, path: Path, target: Path, hidden: Path) -> None:
        self.stop_file = tmp / "swapper.stop"
        self.counter = tmp / "swapper.count"
        self.process = subprocess.Popen(
            [sys.executable, "-c", SWAPPER, "swap", str(path), str(target), str(hidden),
             str(self.stop_file), str(self.counter), str(SWAPPER_DEADLINE_S)]
        )

    async def started(self) -> None:
        with trio.fail_after(STOP_WAIT_S):
            while not self.counter.exists():
                assert self.process.poll() is None, "the swapper died"
                await trio.sleep(0.001)

    def stop(self) -> int:
        """Stop the swapper; how many swaps it made (the workspace is whole again)."""
        self.stop_file.touch()
        assert self.process.wait(timeout=STOP_WAIT_S) == 0
        return int(self.counter.read_text())


@pytest.fixture
def outside(tmp_path) -> Path:
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "f").write_text(SECRET)
    (directory / "secret").write_text(SECRET)
    return directory


def outcome(answer: dict) -> str:
    if answer["ok"]:
        return "leak" if SECRET in answer["result"]["content"] else "inside"
    return answer["error"]["code"]


async def read_while_swapping(session, swapper: Swapper, path: str) -> Counter[str]:
    await swapper.started()
    seen: Counter[str] = Counter()
    try:
        for _ in range(READS):
            seen[outcome(await session.call_and_wait("read_file", {"path": path}))] += 1
    finally:
        swaps = swapper.stop()
    assert swaps > SWAPS_BEFORE_START
    return seen


async def test_a_file_swapped_for_a_symlink_out_is_never_read(daemon, session, tmp_path, outside):
    ws = daemon.layout.workspace
    (ws / "src").mkdir()
    (ws / "src" / "f").write_text(INSIDE)
    swapper = Swapper(tmp_path, ws / "src" / "f", outside / "secret", ws / "src" / ".f-link")
    seen = await read_while_swapping(session, swapper, "src/f")
    assert seen["leak"] == 0, seen
    # Both sides of the swap were seen: the race was really run.
    assert seen["inside"] > 0 and seen["path_outside_workspace"] > 0, seen


async def test_a_directory_swapped_for_a_symlink_out_is_never_read_through(daemon, session, tmp_path, outside):
    ws = daemon.layout.workspace
    (ws / "src").mkdir()
    (ws / "src" / "f").write_text(INSIDE)
    swapper = Swapper(tmp_path, ws / "src", outside, ws / ".src-link")
    seen = await read_while_swapping(session, swapper, "src/f")
    assert seen["leak"] == 0, seen
    assert seen["inside"] > 0 and seen["path_outside_workspace"] > 0, seen


SHA_TEXT = {git_blob_sha(text.encode()): text for text in ("v0\n", "v1\n")}


def modify(path: str, old: str, new: str) -> dict:
    diff = f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old}+{new}"
    return {"path": path, "diff": diff, "base_sha": git_blob_sha(old.encode())}


def create(path: str, text: str) -> dict:
    return {"path": path, "diff": f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{text}", "base_sha": ZERO}


async def test_patches_never_write_through_a_directory_swapped_for_a_symlink(daemon, session, tmp_path, outside):
    """Creates (of files, and of files in new directories) and edits of a file whose
    outside twin has the same content, so the base sha cannot tell them apart."""
    ws = daemon.layout.workspace
    (ws / "dir").mkdir()
    (ws / "dir" / "g").write_text("v0\n")
    (outside / "g").write_text("v0\n")
    before = {name: (outside / name).read_bytes() for name in os.listdir(outside)}
    swapper = Swapper(tmp_path, ws / "dir", outside, ws / ".dir-link")
    await swapper.started()
    seen: Counter[str] = Counter()
    current = "v0\n"
    try:
        for index in range(PATCHES):
            if index % 3 == 0:
                params = create(f"dir/new{index}", "x\n")
            elif index % 3 == 1:
                params = create(f"dir/sub{index}/f", "x\n")
            else:
                nxt = "v1\n" if current == "v0\n" else "v0\n"
                params = modify("dir/g", current, nxt)
            answer = await session.call_and_wait("apply_file_patch", params, idempotency_key=f"p{index}")
            seen["ok" if answer["ok"] else answer["error"]["code"]] += 1
            if answer["ok"] and params["path"] == "dir/g":
                current = nxt
            elif not answer["ok"] and answer["error"]["code"] == "base_sha_mismatch":
                current = SHA_TEXT.get(answer["error"]["current_sha"], current)
    finally:
        swapper.stop()
    assert sorted(os.listdir(outside)) == sorted(before), seen  # nothing created outside
    assert {name: (outside / name).read_bytes() for name in before} == before, seen  # nor changed
    assert seen["ok"] > 0 and seen["path_outside_workspace"] > 0, seen
    assert (ws / "dir" / "g").read_text() == current


async def test_agent_cwd_replaced_after_bootstrap_keeps_the_opened_directory(daemon, session, outside):
    """The root swap: agent.cwd renamed away and a symlink to outside (then to /) put in its
    place after the bootstrap. The file tools go on in the directory opened at bootstrap."""
    ws = daemon.layout.workspace
    (ws / "f").write_text(INSIDE)
    moved = ws.with_name("workspace-moved")
    ws.rename(moved)
    ws.symlink_to(outside)
    read = await session.call_and_wait("read_file", {"path": "f"})
    assert read["ok"] and read["result"]["content"] == INSIDE
    missing = await session.call_and_wait("read_file", {"path": "secret"})
    assert missing["error"]["code"] == "not_found"
    absolute = await session.call_and_wait("read_file", {"path": str(ws / "secret")})
    assert absolute["error"]["code"] == "not_found"
    patched = await session.call_and_wait("apply_file_patch", create("new.txt", "x\n"), idempotency_key="root-swap")
    assert patched["ok"], patched
    assert (moved / "new.txt").read_text() == "x\n"
    assert sorted(os.listdir(outside)) == ["f", "secret"]
    ws.unlink()
    ws.symlink_to("/")
    etc = await session.call_and_wait("read_file", {"path": "etc/hostname"})
    assert etc["error"]["code"] == "not_found"


async def test_a_restarted_daemon_opens_agent_cwd_before_any_call(layout, outside):
    """A bound daemon that restarts opens agent.cwd at start, not at the first call: a swap
    made after the start (before any call) is not followed either."""
    ws = layout.workspace
    (ws / "f").write_text(INSIDE)
    async with in_process_daemon(layout) as first:
        client = first.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(ws))
    async with in_process_daemon(layout) as second:
        moved = ws.with_name("workspace-moved")
        ws.rename(moved)
        ws.symlink_to(outside)
        client.endpoint = second.tcp  # the same control plane: its generations go on
        async with client.connect() as session:
            await session.bootstrap(cwd=str(ws))  # the same body: re-attaches
            read = await session.call_and_wait("read_file", {"path": "f"})
    assert read["ok"] and read["result"]["content"] == INSIDE, read
