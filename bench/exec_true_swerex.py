"""`execute_shell_command` of `true` against SWE-ReX's `execute` of the same command.

Daemon: as `exec_true` (one bootstrapped socket, a `tool.call` of `true` with a fresh
idempotency key, until its `tool.result`).

Peer: SWE-ReX's server (`swerex-remote`, bench/swerex_peer.py) on 127.0.0.1 in its own
process, one keep-alive HTTP connection, `POST /execute` of `["/bin/bash", "-c", "true"]`
(the argv the daemon runs for `true`) until its JSON answer. SWE-ReX journals nothing,
keeps no spool and sends no events; the target asks the daemon to be faster anyway.

Samples alternate (peer, daemon, …). The ratio is SWE-ReX's median over the daemon's (higher is
better); the target is SWE-ReX taking at least 1.5× the daemon's time. Skipped when swe-rex is
not installed (the `bench` extra).
"""

from __future__ import annotations

from pathlib import Path

from bench.common import CpuMeter, Driver, Mode, Result, daemon, key, now, require_ok, workspace
from bench.swerex_peer import compared, require, swerex_server

NAME = "exec_true_swerex"
TARGET = 1.5  # SWE-ReX's time / the daemon's, at least
ARGV = ["/bin/bash", "-c", "true"]


async def run(mode: Mode, workdir: Path) -> Result:
    require()
    samples, warmup = mode.pick(300, 10), mode.pick(20, 2)
    measured: list[float] = []
    peer: list[float] = []
    async with swerex_server(workdir / "swerex.log") as rex, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with rex.client() as http, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid, rex.proc.pid, "SWE-ReX")
                started = now()
                answer = await http.execute(ARGV)
                elapsed_peer = now() - started
                assert answer["exit_code"] == 0, answer
                started = now()
                body = await driver.call("execute_shell_command", {"command": "true"}, key=key())
                elapsed = now() - started
                assert require_ok(body)["exit_code"] == 0, body
                await driver.maybe_ack()
                if i >= warmup:
                    peer.append(elapsed_peer)
                    measured.append(elapsed)
            meter.stop()
    return compared(NAME, TARGET, measured, peer, meter.per_op(samples))
