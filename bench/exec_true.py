"""2. `execute_shell_command` of `true`, call → `tool.result`.

Daemon: on one bootstrapped socket, a `tool.call` of `true` with a fresh idempotency key, until
its `tool.result` arrives (the daemon journals the idempotency record, exec.started, and
exec.completed + tool.result in between).

Floor: on one socket to the floor server, a message on which the server runs
`trio.run_process(["bash", "-c", "true"])` and answers: the spawn plus one round trip.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import CpuMeter, Driver, Mode, Result, daemon, floor_server, key, now, require_ok, time_ratio_result, workspace

NAME = "exec_true"
TARGET = 1.3


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(500, 10), mode.pick(20, 2)
    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid, fs.proc.pid)
                started = now()
                await ws.send_message("R")
                await ws.get_message()
                elapsed_floor = now() - started
                started = now()
                body = await driver.call("execute_shell_command", {"command": "true"}, key=key())
                elapsed = now() - started
                result = require_ok(body)
                assert result["exit_code"] == 0, result
                await driver.maybe_ack()
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
    return time_ratio_result(NAME, measured, floor, TARGET, meter.per_op(samples))
