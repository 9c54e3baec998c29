"""`execute_shell_command` of `true` against SWE-ReX's `execute` of the same command.

Daemon: as `exec_true` (one bootstrapped socket, a `tool.call` of `true` with a fresh
idempotency key, until its `tool.result`).

Peer: SWE-ReX's server (`swerex-remote`, bench/swerex_peer.py) on 127.0.0.1 in its own
process, one keep-alive HTTP connection, `POST /execute` of `["/bin/bash", "-c", "true"]`
(the argv the daemon runs for `true`) until its JSON answer. SWE-ReX journals nothing,
keeps no spool and sends no events; the target asks the daemon to be faster anyway.

Samples alternate in blocks (peer, daemon, …: `common.alternate`). The ratio is SWE-ReX's
median over the daemon's (higher is better); the target is SWE-ReX taking at least 1.5× the
daemon's time. Skipped when swe-rex is not installed (the `bench` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import Driver, Mode, Result, key, require_ok
from bench.swerex_peer import alternated, compared, require

NAME = "exec_true_swerex"
TARGET = 1.5  # SWE-ReX's time / the daemon's, at least
ARGV = ["/bin/bash", "-c", "true"]


async def run(mode: Mode, workdir: Path) -> Result:
    require()
    samples, warmup = mode.pick(300, 10), mode.pick(20, 2)

    async def on_daemon(driver: Driver) -> dict[str, Any]:
        return await driver.call("execute_shell_command", {"command": "true"}, key=key())

    def check_peer(answer: dict[str, Any]) -> None:
        assert answer["exit_code"] == 0, answer

    def check_daemon(body: dict[str, Any]) -> None:
        assert require_ok(body)["exit_code"] == 0, body

    measured, peer, meter, done = await alternated(
        workdir, samples, warmup, lambda http: http.execute(ARGV), on_daemon, check_peer, check_daemon
    )
    return compared(NAME, TARGET, measured, peer, meter.per_op(done))
