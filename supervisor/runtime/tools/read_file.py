"""read_file (docs/protocol.md §7.3): a byte range of a jailed file, with the file's sha.

Small files are read at once in the socket's own task (no worker-thread hop, no task to
spawn); larger ones in a worker thread. A pending read_file is never re-run after a crash: it
had no effect, and is reported interrupted like any call without a recovery.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio

from sandbox_supervisor.protocol.tools import ReadFileParams, tool_spec
from sandbox_supervisor.daemon.runtime.files import read_file_result
from sandbox_supervisor.daemon.runtime.paths import resolve_in_jail
from sandbox_supervisor.daemon.runtime.tool import Recover, RunningCall, Tool, ToolServices

NAME = "read_file"
# Hashing a file is the slow part of read_file; below this size it is cheaper to do it on
# the trio thread than to pay for a worker-thread hop (~50-100 µs).
INLINE_READ_MAX_BYTES = 1024 * 1024
recover: Recover | None = None


def bind(services: ToolServices) -> Tool:
    return Tool(tool_spec(NAME), run=run, run_now=run_now)


def run_now(running: RunningCall) -> dict[str, Any] | None:
    """The result of a small file at once (or its typed failure), None for a file worth a
    worker thread."""
    target, params = _target(running)
    return _read_if_small(target, params)


async def run(running: RunningCall) -> dict[str, Any]:
    target, params = _target(running)
    result = _read_if_small(target, params)  # the file shrank since the fast path passed it on
    if result is not None:
        return result
    return await trio.to_thread.run_sync(read_file_result, target, params.path, params)


def _target(running: RunningCall) -> tuple[Path, ReadFileParams]:
    params = running.call.parameters
    assert isinstance(params, ReadFileParams)
    ctx = running.context
    return resolve_in_jail(ctx.cwd, params.path, ctx.allowed_paths), params


def _read_if_small(target: Path, params: ReadFileParams) -> dict[str, Any] | None:
    try:
        size = os.stat(target).st_size
    except OSError:
        size = 0  # read_file_result reports the precise error
    if size <= INLINE_READ_MAX_BYTES:
        return read_file_result(target, params.path, params)
    return None
