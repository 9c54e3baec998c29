"""2. `execute_shell_command` of `true`, call → `tool.result`.

Daemon: on one bootstrapped socket, a `tool.call` of `true` with a fresh idempotency key, until
its `tool.result` arrives (the daemon journals the idempotency record, exec.started, and
exec.completed + tool.result in between).

Floor: on one socket to the floor server, a message on which the server runs
`trio.run_process(["bash", "-c", "true"])` and answers: the spawn plus one round trip.

The two alternate in blocks (`common.alternate`).
"""

from __future__ import annotations

from pathlib import Path

from bench.common import CpuMeter, Driver, Mode, Result, alternate, daemon, floor_server, key, now, require_ok, time_ratio_result, workspace

NAME = "exec_true"
TARGET = 1.3


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(500, 10), mode.pick(20, 2)
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            meters: list[CpuMeter] = []

            async def on_floor() -> float:
                started = now()
                await ws.send_message("R")
                await ws.get_message()
                return now() - started

            async def on_daemon() -> float:
                started = now()
                body = await driver.call("execute_shell_command", {"command": "true"}, key=key())
                elapsed = now() - started
                result = require_ok(body)
                assert result["exit_code"] == 0, result
                await driver.maybe_ack()
                return elapsed

            floor, measured, done = await alternate(
                samples, warmup, on_floor, on_daemon, lambda: meters.append(CpuMeter(process.proc.pid, fs.proc.pid))
            )
            meters[0].stop()
    return time_ratio_result(NAME, measured, floor, TARGET, meters[0].per_op(done))
