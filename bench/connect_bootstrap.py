"""1. connect + authenticate + bootstrap → runtime.state.

Daemon: a fresh WebSocket to the daemon (the upgrade gate verifies an ES256 assertion and
records the fence and jti in sqlite), `session.bootstrap`, until `runtime.state` arrives — the
steady-state reconnect of a bound session (the first, binding connection is not timed). The
assertion is signed before the timer starts: the client's signing is not the daemon's cost.

Floor: a fresh WebSocket to the bare trio-websocket floor server, opened with the same client
code, and one echo round trip of a message as large as the bootstrap frame.

The close handshake is outside the timed region for both.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import CpuMeter, Mode, Result, daemon, echo, echo_text, floor_server, now, premint, time_ratio_result, workspace
from sandbox_supervisor.testing.client import default_bootstrap_body

NAME = "connect_bootstrap"
TARGET = 1.5


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(300, 10), mode.pick(10, 2)
    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        cwd = workspace(running.layout)
        async with client.connect() as session:  # binds the session (once, not timed)
            await session.bootstrap(cwd=cwd)
        payload = echo_text(
            {"kind": "session.bootstrap", "connectionGeneration": 1, "body": default_bootstrap_body(client.session_id, cwd)}
        )
        for i in range(warmup + samples):
            if i == warmup:
                meter = CpuMeter(process.proc.pid, fs.proc.pid)
            started = now()
            async with fs.connect() as ws:
                await echo(ws, payload)
                elapsed_floor = now() - started
            args = premint(client)
            started = now()
            async with client.connect(**args) as session:
                state = await session.bootstrap(cwd=cwd)
                elapsed = now() - started
            assert state["kind"] == "runtime.state", json.dumps(state)
            if i >= warmup:
                floor.append(elapsed_floor)
                measured.append(elapsed)
        meter.stop()
    return time_ratio_result(NAME, measured, floor, TARGET, meter.per_op(samples))
