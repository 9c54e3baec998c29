"""read_file (docs/protocol.md §7.3): a byte range of a jailed file, with the file's sha.

Small files are read at once in the socket's own task (no worker-thread hop, no task to
spawn); larger ones in a worker thread. "Small" is decided by the fstat of the opened file,
and the fast path reads at most that many bytes, once: a file that grows or changes during
it is handed to the worker thread, so the trio thread never waits on a file an agent keeps
writing. A pending read_file is never re-run after a crash: it had no effect, and is
reported interrupted like any call without a recovery.

Worker-thread reads hold a token of their own limiter (`ToolServices.read_limiter`), so
reads can fill only their own threads, never the ones a patch or the state store needs; and
they are abandoned when the call is cancelled (a stop, SIGTERM): a read has no effect to
finish, so nothing waits for it. The abandoned thread keeps its limiter token until it ends,
which is soon: every read is bounded by `[files] max_file_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import trio

from sandbox_supervisor.protocol.tools import ReadFileParams, tool_spec
from sandbox_supervisor.daemon.runtime.files import Opener, read_file_result
from sandbox_supervisor.daemon.runtime.paths import READ_FLAGS, JailedPath, open_in_jail
from sandbox_supervisor.daemon.runtime.tool import Recover, RunningCall, Tool, ToolServices

NAME = "read_file"
# Hashing a file is the slow part of read_file; below this size it is cheaper to do it on
# the trio thread than to pay for a worker-thread hop (~50-100 µs).
INLINE_READ_MAX_BYTES = 1024 * 1024
recover: Recover | None = None


def bind(services: ToolServices) -> Tool:
    # services is read when a call runs, not here: binding needs nothing from it.

    def run_now(running: RunningCall) -> dict[str, Any] | None:
        """The result of a small file at once (or its typed failure), None for a file worth
        a worker thread."""
        target, params = _target(running, services)
        return read_file_result(
            target,
            params.path,
            params,
            max_file_bytes=services.max_file_bytes,
            inline_max_bytes=INLINE_READ_MAX_BYTES,
        )

    async def run(running: RunningCall) -> dict[str, Any]:
        target, params = _target(running, services)
        read = partial(
            read_file_result, target, params.path, params, max_file_bytes=services.max_file_bytes
        )
        result = await trio.to_thread.run_sync(
            read, limiter=services.read_limiter, abandon_on_cancel=True
        )
        assert result is not None  # without inline_max_bytes, a result or a ToolFailure
        return result

    return Tool(tool_spec(NAME), run=run, run_now=run_now)


def _target(running: RunningCall, services: ToolServices) -> tuple[Opener, ReadFileParams]:
    """How to open the file: a walk from agent.cwd's descriptor (opened at bootstrap), done
    by read_file_result itself, so the file read is the file the jail judged."""
    params = running.call.parameters
    assert isinstance(params, ReadFileParams)
    ctx = running.context
    root = services.roots.get(ctx.cwd)

    @contextmanager
    def opener() -> Iterator[JailedPath]:
        with open_in_jail(root, params.path, ctx.allowed_paths, READ_FLAGS) as jailed:
            # Who may see the result depends on the real path (docs/protocol.md §9.1).
            running.view_path = jailed.real_text
            yield jailed

    return opener, params
