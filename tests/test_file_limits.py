"""File tools are bounded and never block the event loop (docs/protocol.md §7.3, §7.5;
`[files] max_file_bytes`): a size limit checked on the opened file before a byte is read,
reads that stop at the size seen at open, and worker threads of their own for reads and for
patches. Real files throughout; sparse files (os.truncate) make huge sizes instant."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
import uuid

import pytest
import trio

from sandbox_supervisor.protocol.errors import BASE_SHA_MISMATCH, FILE_TOO_LARGE
from sandbox_supervisor.protocol.tools import ApplyFilePatchParams, ReadFileParams
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.files import DEFAULT_MAX_FILE_BYTES, read_file_result
from sandbox_supervisor.daemon.runtime.patch import git_blob_sha, plan_patch
from sandbox_supervisor.testing.client import http_request

from test_file_tools_wire import patch_params
from sandbox_supervisor.daemon.state.keys import CallKey

MIB = 1024 * 1024
TIB = 1024 * 1024 * MIB
# Long enough for a loaded CI machine to answer a typed error; far shorter than hashing
# (or loading) the files below, which takes seconds to hours.
ANSWER_DEADLINE_S = 5.0
HEALTH_DEADLINE_S = 1.0
# The growing file: extended (sparsely, no disk used) by this much per step, up to the cap.
GROWTH_STEP_BYTES = 8 * MIB
GROWTH_CAP_BYTES = 8 * 1024 * MIB
GROWTH_PAUSE_S = 0.001
# A wrong-sha patch of a file under the limit hashes it in chunks: a few MiB of peak
# allocation at most, where loading it would take the whole file.
STREAMED_FILE_BYTES = 64 * MIB
STREAMED_PEAK_LIMIT_BYTES = 16 * MIB


def sparse(path, size: int) -> None:
    path.write_bytes(b"")
    os.truncate(path, size)


# --- the size limit -----------------------------------------------------------------------


def test_a_sparse_file_over_the_max_is_refused_before_reading(tmp_path):
    target = tmp_path / "huge.bin"
    sparse(target, TIB)
    started = time.monotonic()
    with pytest.raises(ToolFailure) as caught:
        read_file_result(target, "huge.bin", ReadFileParams(path="huge.bin"), max_file_bytes=MIB)
    assert time.monotonic() - started < ANSWER_DEADLINE_S
    assert caught.value.to_error() == {
        "code": FILE_TOO_LARGE,
        "message": f"The file is {TIB} bytes; the limit is {MIB} bytes.",
        "size": TIB,
        "max_bytes": MIB,
    }


async def test_read_file_of_a_huge_sparse_file_is_file_too_large_at_once(daemon, session):
    sparse(daemon.layout.workspace / "huge.bin", TIB)
    with trio.fail_after(ANSWER_DEADLINE_S):
        answer = await session.call_and_wait("read_file", {"path": "huge.bin"})
    assert answer["ok"] is False
    assert answer["error"]["code"] == FILE_TOO_LARGE
    assert answer["error"]["size"] == TIB
    assert answer["error"]["max_bytes"] == DEFAULT_MAX_FILE_BYTES


async def test_wrong_sha_patch_of_a_file_over_the_max_is_file_too_large_unloaded(daemon, session):
    # Just over the default limit: today's code would load all of it (and answer
    # base_sha_mismatch); the limit answers before a byte is read.
    size = DEFAULT_MAX_FILE_BYTES + MIB
    target = daemon.layout.workspace / "big.txt"
    sparse(target, size)
    tracemalloc.start()
    try:
        with trio.fail_after(ANSWER_DEADLINE_S):
            answer = await session.call_and_wait(
                "apply_file_patch", patch_params("big.txt", "a\n", "b\n"), idempotency_key="big"
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert answer["ok"] is False
    assert answer["error"]["code"] == FILE_TOO_LARGE
    assert answer["error"]["size"] == size
    assert peak < STREAMED_PEAK_LIMIT_BYTES
    assert os.stat(target).st_size == size


def test_a_patch_whose_result_exceeds_the_max_is_refused(tmp_path):
    target = tmp_path / "f.txt"
    target.write_bytes(b"a\n")
    params = ApplyFilePatchParams.model_validate(
        patch_params("f.txt", "a\n", "a\n" + "x" * 100 + "\n")
    )
    with pytest.raises(ToolFailure) as caught:
        plan_patch(target, "f.txt", params, max_file_bytes=50)
    assert caught.value.code == FILE_TOO_LARGE
    assert target.read_bytes() == b"a\n"


def test_a_wrong_sha_patch_hashes_in_chunks_without_loading_the_file(tmp_path):
    target = tmp_path / "mid.txt"
    sparse(target, STREAMED_FILE_BYTES)
    params = ApplyFilePatchParams.model_validate(patch_params("mid.txt", "a\n", "b\n"))
    tracemalloc.start()
    try:
        with pytest.raises(ToolFailure) as caught:
            plan_patch(target, "mid.txt", params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.code == BASE_SHA_MISMATCH
    assert caught.value.to_error()["current_sha"] == git_blob_sha(bytes(STREAMED_FILE_BYTES))
    assert peak < STREAMED_PEAK_LIMIT_BYTES


# --- a file that keeps growing --------------------------------------------------------------


def test_the_fast_path_leaves_a_file_larger_than_its_bound_unread(tmp_path):
    target = tmp_path / "huge.bin"
    sparse(target, TIB)
    params = ReadFileParams(path="huge.bin")
    started = time.monotonic()
    assert (
        read_file_result(target, "huge.bin", params, max_file_bytes=2 * TIB, inline_max_bytes=MIB)
        is None
    )
    assert time.monotonic() - started < ANSWER_DEADLINE_S


async def test_a_file_that_keeps_growing_neither_freezes_the_daemon_nor_holds_the_read(
    daemon, session
):
    """An agent's process extends a file while read_file reads it: the answer comes at once
    (the size seen at open, or a typed error), and /healthz answers meanwhile."""
    head = b"first line\n" * 100
    target = daemon.layout.workspace / "growing.log"
    target.write_bytes(head)
    stop = threading.Event()

    def grow() -> None:
        with open(target, "r+b") as file:
            size = len(head)
            while not stop.is_set() and size < GROWTH_CAP_BYTES:
                size += GROWTH_STEP_BYTES
                os.ftruncate(file.fileno(), size)  # sparse: no disk used
                time.sleep(GROWTH_PAUSE_S)

    health_times: list[float] = []

    async def probe_health(task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            started = time.monotonic()
            response = await http_request(daemon.tcp, "GET", "/healthz", timeout=HEALTH_DEADLINE_S)
            assert response.status == 200
            health_times.append(time.monotonic() - started)

    writer = threading.Thread(target=grow, daemon=True)
    writer.start()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(probe_health)
            started = time.monotonic()
            answer = await session.call_and_wait("read_file", {"path": "growing.log"})
            elapsed = time.monotonic() - started
            nursery.cancel_scope.cancel()
    finally:
        stop.set()
        writer.join()
    # Measured, not fail_after: with the old code the trio thread itself was stuck.
    assert elapsed < ANSWER_DEADLINE_S
    assert all(took < HEALTH_DEADLINE_S for took in health_times)
    if answer["ok"]:
        result = answer["result"]
        size = result["size"]
        assert len(head) <= size <= DEFAULT_MAX_FILE_BYTES
        # sha and size describe one version: the head, then the zeros the writer added.
        assert result["sha"] == git_blob_sha(head + bytes(size - len(head)))
    else:
        assert answer["error"]["code"] in {FILE_TOO_LARGE, "internal"}


# --- worker threads of their own ------------------------------------------------------------


async def test_file_tools_do_not_need_the_default_thread_limiter(daemon, session):
    """Reads and patches hold tokens of their own limiters: with trio's default limiter
    (shared by every other to_thread call) exhausted, both still complete."""
    workspace = daemon.layout.workspace
    (workspace / "p.txt").write_bytes(b"a\n")
    big = workspace / "big.bin"
    big.write_bytes(b"x" * (2 * MIB))  # over the inline bound: a worker-thread read
    default = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(default.total_tokens))]
    for holder in holders:
        await default.acquire_on_behalf_of(holder)
    try:
        with trio.fail_after(ANSWER_DEADLINE_S):
            patched = await session.call_and_wait(
                "apply_file_patch", patch_params("p.txt", "a\n", "b\n"), idempotency_key="p"
            )
            read = await session.call_and_wait("read_file", {"path": "big.bin", "length": 4})
    finally:
        for holder in holders:
            default.release_on_behalf_of(holder)
    assert patched["ok"] is True and (workspace / "p.txt").read_bytes() == b"b\n"
    assert read["ok"] is True and read["result"]["size"] == 2 * MIB


async def test_reads_filling_their_limiter_do_not_delay_a_patch(tmp_path):
    """The limiter wiring, with the real tool modules and a real store: the read limiter's
    only token is held (as slow reads would hold it), so a read waits for it, while a patch,
    on its own limiter, completes. (A read that blocks for as long as a test wants is not
    something a regular file offers deterministically, hence the held token.)"""
    from sandbox_supervisor.protocol.tools import parse_tool_call
    from sandbox_supervisor.daemon.runtime.tool import CallContext, RunningCall, ToolServices
    from sandbox_supervisor.daemon.runtime.tools import apply_file_patch, read_file
    from sandbox_supervisor.daemon.state.store import StateStore

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "big.bin").write_bytes(b"x" * (2 * MIB))  # over the inline bound
    (workspace / "p.txt").write_bytes(b"a\n")
    context = CallContext(
        session_id="s", generation=1, cwd=str(workspace), agent_env={},
        scopes=frozenset({"files:read", "files:write"}), allowed_paths=None, allowed_commands=None,
    )
    read_limiter = trio.CapacityLimiter(1)
    with StateStore.open(tmp_path / "state") as store:
        services = ToolServices(
            store=store, file_write_lock=trio.Lock(), shell=None,  # type: ignore[arg-type]
            read_limiter=read_limiter,
        )
        reader, patcher = read_file.bind(services), apply_file_patch.bind(services)
        read_call = parse_tool_call(
            {"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": "big.bin", "length": 1}}
        )
        PATCH_CALL_ID = str(uuid.uuid4())
        patch_call = parse_tool_call(
            {
                "tool_name": "apply_file_patch", "call_id": PATCH_CALL_ID, "idempotency_key": "p",
                "parameters": patch_params("p.txt", "a\n", "b\n"),
            }
        )
        assert store.begin_call(
            key=CallKey(context.key_space, "p"), tool_name="apply_file_patch", digest="d", call_id=PATCH_CALL_ID, intent_json="{}"
        ) is None
        results: dict[str, dict] = {}

        async def run_read() -> None:
            results["read"] = await reader.run(RunningCall(read_call, context))

        holder = object()
        await read_limiter.acquire_on_behalf_of(holder)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_read)
            await trio.testing.wait_all_tasks_blocked()
            assert read_limiter.statistics().tasks_waiting == 1  # the read waits for a thread
            with trio.fail_after(ANSWER_DEADLINE_S):
                results["patch"] = await patcher.run(RunningCall(patch_call, context))
            assert "read" not in results
            read_limiter.release_on_behalf_of(holder)
    assert results["patch"]["new_sha"] == git_blob_sha(b"b\n")
    assert (workspace / "p.txt").read_bytes() == b"b\n"
    assert results["read"]["size"] == 2 * MIB


async def test_a_cancelled_read_is_abandoned_not_waited_for(tmp_path, monkeypatch):
    """A read in a worker thread does not hold up its cancellation (a stop, SIGTERM): the
    thread is abandoned. The thread is held at its start by a test-owned lock taken inside
    the read (reading the file's directory entry is not blockable), so it is still running
    when the cancel arrives."""
    from sandbox_supervisor.protocol.tools import parse_tool_call
    from sandbox_supervisor.daemon.runtime.tool import CallContext, RunningCall, ToolServices
    from sandbox_supervisor.daemon.runtime.tools import read_file

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "big.bin").write_bytes(b"x" * (2 * MIB))
    context = CallContext(
        session_id="s", generation=1, cwd=str(workspace), agent_env={},
        scopes=frozenset({"files:read"}), allowed_paths=None, allowed_commands=None,
    )
    services = ToolServices(store=None, file_write_lock=trio.Lock(), shell=None)  # type: ignore[arg-type]
    reader = read_file.bind(services)
    call = parse_tool_call({"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": "big.bin"}})
    gate = threading.Event()
    entered = threading.Event()
    from sandbox_supervisor.daemon.runtime import files as files_module

    real_open = files_module.open_regular_file

    def held_open(path, **options):
        entered.set()
        gate.wait()
        return real_open(path, **options)

    monkeypatch.setattr(files_module, "open_regular_file", held_open)

    async def watchdog() -> None:
        # Frees the thread if the cancel waits for it (the failure this test catches), so
        # the test fails instead of hanging.
        await trio.sleep(ANSWER_DEADLINE_S)
        gate.set()

    try:
        async with trio.open_nursery() as guard:
            guard.start_soon(watchdog)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reader.run, RunningCall(call, context))
                    with trio.fail_after(ANSWER_DEADLINE_S):
                        await trio.to_thread.run_sync(entered.wait, abandon_on_cancel=True)
                    cancelled_at = time.monotonic()
                    scope.cancel()
            took = time.monotonic() - cancelled_at
            freed_by_watchdog = gate.is_set()
            guard.cancel_scope.cancel()
    finally:
        gate.set()
    assert not freed_by_watchdog and took < ANSWER_DEADLINE_S


# --- configuration ---------------------------------------------------------------------------


def test_max_file_bytes_is_validated():
    from sandbox_supervisor.daemon.config import ConfigError, load_config

    base = {"authority.issuer": "https://issuer", "authority.jwks_file": "/k.json"}
    assert load_config(None, env={}, overrides=base).files.max_file_bytes == DEFAULT_MAX_FILE_BYTES
    for bad in (0, -1, "1MiB", 1.5):
        with pytest.raises(ConfigError) as caught:
            load_config(None, env={}, overrides={**base, "files.max_file_bytes": bad})
        assert [key for key, _ in caught.value.problems] == ["files.max_file_bytes"]


async def test_the_configured_max_is_what_the_tools_enforce(tmp_path, authority):
    from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

    layout = make_layout(tmp_path / "d", authority=authority, files={"max_file_bytes": 1024})
    (layout.workspace / "f.txt").write_bytes(b"y" * 1025)
    (layout.workspace / "ok.txt").write_bytes(b"y" * 1024)
    async with in_process_daemon(layout) as running:
        async with running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            refused = await session.call_and_wait("read_file", {"path": "f.txt"})
            read = await session.call_and_wait("read_file", {"path": "ok.txt"})
            patched = await session.call_and_wait(
                "apply_file_patch",
                patch_params("f.txt", "y" * 1025, "z\n"),
                idempotency_key="k",
            )
    assert refused["error"] == {
        "code": FILE_TOO_LARGE,
        "message": "The file is 1025 bytes; the limit is 1024 bytes.",
        "size": 1025,
        "max_bytes": 1024,
    }
    assert read["ok"] is True and read["result"]["size"] == 1024
    assert patched["error"]["code"] == FILE_TOO_LARGE
