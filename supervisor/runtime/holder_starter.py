"""Starting holders through the fork server (holder_forkserver.py), from trio.

`HolderStarter.launch(directory, spec)` is `launch_holder` (holder_launch.py) without an
interpreter start per process: it writes spec.json, asks the fork server, and reads the
holder.json the holder wrote. Launches are serialised (the server answers one at a time).
The server is started on first use and again if it died; one that does not answer within
the launch deadline is killed, so no late holder starts a process the daemon gave up on
(what it may have started is the caller's to clean up, as for `launch_holder`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import structlog
import trio

from sandbox_supervisor.daemon.runtime.holder_launch import LAUNCH_TIMEOUT_S, HolderLaunchError, launched, write_spec
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    HOLDER_FAILED,
    HolderInfo,
    HolderProtocolError,
    HolderSpec,
    LineSplitter,
)

log = structlog.get_logger("supervisor.holders")

FORKSERVER_MODULE = "sandbox_supervisor.daemon.runtime.holder_forkserver"
READ_CHUNK_BYTES = 4096


class HolderStarter:
    def __init__(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = trio.Lock()
        self._process: trio.Process | None = None
        self._lines = LineSplitter()
        self._ready: list[bytes] = []

    async def launch(self, directory: Path, spec: HolderSpec) -> HolderInfo:
        directory = Path(directory).resolve()
        write_spec(directory, spec)
        # Shielded (each request is bounded by the deadline): a launch cut off between its
        # request and the answer would leave a holder nobody records, and the server's next
        # answer taken for another request's.
        with trio.CancelScope(shield=True):
            async with self._lock:
                status = await self._ask(os.fsencode(directory))
        return launched(directory, status)

    async def _ask(self, line: bytes) -> int:
        process = await self._server()
        assert process.stdin is not None and process.stdout is not None
        try:
            with trio.fail_after(self.timeout_s):
                await process.stdin.send_all(line + b"\n")
                while not self._ready:
                    data = await process.stdout.receive_some(READ_CHUNK_BYTES)
                    if not data:
                        raise trio.BrokenResourceError("the fork server ended")
                    self._ready.extend(self._lines.feed(bytes(data)))
        except trio.TooSlowError:
            await self._discard("did not answer")
            raise HolderLaunchError("holder_timeout", f"the fork server did not start a holder within {self.timeout_s} s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, HolderProtocolError) as exc:
            await self._discard(str(exc))
            raise HolderLaunchError(HOLDER_FAILED, f"the fork server failed: {exc}") from None
        answer = self._ready.pop(0)
        status, _, echoed = answer.partition(b" ")
        if echoed != line or not status.lstrip(b"-").isdigit():
            await self._discard("answered out of turn")
            raise HolderLaunchError(HOLDER_FAILED, "the fork server answered out of turn")
        return int(status)

    async def _server(self) -> trio.Process:
        if self._process is None or self._process.returncode is not None:
            self._lines = LineSplitter()
            self._ready = []
            self._process = await trio.lowlevel.open_process(
                [sys.executable, "-I", "-m", FORKSERVER_MODULE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a stop's signals to the daemon's group miss it
                cwd="/",
            )
        return self._process

    async def _discard(self, why: str) -> None:
        """Kill a server that failed; the next launch starts a new one."""
        process, self._process = self._process, None
        if process is None:
            return
        log.warning("holders.forkserver_restarted", reason=why)
        with trio.CancelScope(shield=True):
            process.kill()
            await process.wait()

    async def aclose(self) -> None:
        """End the server (closing its stdin); holders it started run on."""
        process, self._process = self._process, None
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                await process.stdin.aclose()
            with trio.move_on_after(self.timeout_s):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
