"""4. Sequential `read_file` calls per second.

Daemon: one call after the other on one bootstrapped socket, each reading a 256-byte text
file (no idempotency key, as a pager would), each waited for before the next is sent.

Floor: sequential echo round trips on one socket to the floor server, each message the same
`tool.call` frame text the daemon receives.

Samples alternate in blocks (floor block, daemon block, …); the rates are total calls over
total time. The ratio is daemon rate / floor rate (higher is better).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from bench.common import CpuMeter, Driver, Mode, Result, daemon, echo, echo_text, floor_server, latency, now, require_ok, workspace

NAME = "read_file_rate"
TARGET = 0.6
FILE_BYTES = 256


async def run(mode: Mode, workdir: Path) -> Result:
    blocks, per_block, warmup = mode.pick(10, 2), mode.pick(400, 40), mode.pick(50, 5)
    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        (running.layout.workspace / "small.txt").write_text(("0123456789abcde\n" * (FILE_BYTES // 16)))
        params = {"path": "small.txt", "offset": 0}
        frame = {
            "kind": "tool.call",
            "connectionGeneration": 1,
            "body": {"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": params},
        }
        payload = echo_text(frame)
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for block in range(-1, blocks):  # block -1 is the warm-up
                if block == 0:
                    meter = CpuMeter(process.proc.pid, fs.proc.pid)
                count = warmup if block < 0 else per_block
                for _ in range(count):
                    started = now()
                    await echo(ws, payload)
                    elapsed = now() - started
                    if block >= 0:
                        floor.append(elapsed)
                for _ in range(count):
                    started = now()
                    body = await driver.call("read_file", params)
                    elapsed = now() - started
                    assert require_ok(body)["size"] == FILE_BYTES
                    await driver.maybe_ack()
                    if block >= 0:
                        measured.append(elapsed)
            meter.stop()
    measured_rate = len(measured) / sum(measured)
    floor_rate = len(floor) / sum(floor)
    ratio = measured_rate / floor_rate
    return Result(
        NAME,
        f"{measured_rate:,.0f} calls/s ({latency(measured)})",
        f"{floor_rate:,.0f} round trips/s ({latency(floor)})",
        ratio,
        f">= {TARGET:g}x",
        ratio >= TARGET,
        meter.per_op(blocks * per_block),
    )
