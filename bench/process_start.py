"""10. A held process's start: `start_process` of `echo hi` until its `exec.started` and its
first output (`hi`) have arrived.

Daemon: on one bootstrapped socket, `start_process` with a fresh key, until the socket has
received the process's `exec.started` and an `exec.output` holding `hi`: the idempotency
record, the holder's launch (an interpreter start, its fork, the process's exec), the journal,
the holder's spool write, the daemon's read of it.

Floor: on one socket to the floor server, a message on which the server runs `bash -c "echo
hi"` with its output captured and answers with it: the spawn, the first output, one round trip.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import CpuMeter, Mode, Result, daemon, floor_server, key, now, time_ratio_result, workspace

NAME = "process_start"
# What a start should cost: a spawn and a few round trips. The holders' fork server took the
# interpreter start (~40 ms, see holder_launch) out of it; what is left is mostly the forks
# of the holder's start (the server's starter, the holder, the process) and their reports.
TARGET = 3.0
COMMAND = "echo hi"


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(40, 3), mode.pick(3, 1)
    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid, fs.proc.pid)
                started = now()
                await ws.send_message("S" + COMMAND)
                await ws.get_message()
                elapsed_floor = now() - started
                started = now()
                call_id = await session.call("start_process", {"command": COMMAND}, idempotency_key=key())
                seen_started = seen_output = False
                while not (seen_started and seen_output):
                    frame = await session.ws.get_message()  # raw text: no parse in the timed loop
                    if call_id in frame:
                        seen_started = seen_started or '"exec.started"' in frame
                        seen_output = seen_output or ('"exec.output"' in frame and "hi" in frame)
                elapsed = now() - started
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
    return time_ratio_result(NAME, measured, floor, TARGET, meter.per_op(samples))
