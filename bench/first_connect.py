"""The first connect, the one that binds the session: connect + authenticate + the first
`session.bootstrap`, until `runtime.state`.

Daemon: for each sample a fresh daemon on fresh directories (started and ready before the
timer starts), then a new WebSocket to it (the upgrade gate: the sandbox id is read, the ES256
assertion verified, the fence and jti recorded) and the first `session.bootstrap`: the body
checked against the file system, the binding persisted, `runtime.state` sent. The assertion is
signed before the timer starts.

Floor: a new WebSocket to the bare floor server, opened with the same client code, and one
echo of a message as large as the bootstrap frame (as `connect_bootstrap`'s floor).

Each sample pays a daemon start outside the timed region, so this row takes fewer samples
than the others.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import Mode, Result, cpu_seconds, daemon, echo, echo_text, floor_server, now, premint, time_ratio_result, workspace
from sandbox_supervisor.testing.client import default_bootstrap_body

NAME = "first_connect"
TARGET = 3.0


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(15, 2), 1
    measured: list[float] = []
    floor: list[float] = []
    cpu = {"daemon": 0.0, "floor": 0.0}
    async with floor_server() as fs:
        for i in range(warmup + samples):
            async with daemon(workdir / f"daemon-{i}") as (process, running):
                client = running.client()
                cwd = workspace(running.layout)
                payload = echo_text(
                    {"kind": "session.bootstrap", "connectionGeneration": 1, "body": default_bootstrap_body(client.session_id, cwd)}
                )
                floor_cpu = cpu_seconds(fs.proc.pid)
                started = now()
                async with fs.connect() as ws:
                    await echo(ws, payload)
                    elapsed_floor = now() - started
                floor_cpu = cpu_seconds(fs.proc.pid) - floor_cpu
                args = premint(client)
                daemon_cpu = cpu_seconds(process.proc.pid)
                started = now()
                async with client.connect(**args) as session:
                    state = await session.bootstrap(cwd=cwd)
                    elapsed = now() - started
                daemon_cpu = cpu_seconds(process.proc.pid) - daemon_cpu
                assert state["kind"] == "runtime.state", json.dumps(state)
            if i >= warmup:
                floor.append(elapsed_floor)
                measured.append(elapsed)
                cpu["daemon"] += daemon_cpu
                cpu["floor"] += floor_cpu
    note = "server CPU/op: " + ", ".join(f"{name} {used / samples * 1e6:.0f} us" for name, used in cpu.items())
    return time_ratio_result(NAME, measured, floor, TARGET, note + " (the daemon's includes its close)")
