"""10. A held process's start: `start_process` of `echo hi` until its `exec.started` and its
first output (`hi`) have arrived.

Daemon: on one bootstrapped socket, `start_process` with a fresh key, until the socket has
received the process's `exec.started` and an `exec.output` holding `hi`: the idempotency
record, the holder's launch (an interpreter start, its fork, the process's exec), the journal,
the holder's spool write, the daemon's read of it.

Floor: on one socket to the floor server, a message on which the server runs `bash -c "echo
hi"` with its output captured and answers with it: the spawn, the first output, one round trip.

Each daemon sample is followed by SETTLE_S of quiet, so that what the daemon does after a
start (its next spare holder) stays out of the floor's next sample.
"""

from __future__ import annotations

from pathlib import Path

import trio

from bench.common import CpuMeter, Mode, Result, daemon, floor_server, key, now, time_ratio_result, workspace

NAME = "process_start"
# What a start should cost: a spawn and a few round trips. The holders' fork server took the
# interpreter start (~40 ms, see holder_launch) out of it; what is left is mostly the forks
# of the holder's start (the server's starter, the holder, the process) and their reports.
TARGET = 3.0
COMMAND = "echo hi"
# After each daemon sample, before the next floor sample: the fork server forks its next
# spare holder 5 ms after answering (holder_forkserver.SPARE_DELAY_S), and that fork and its
# warm-up, landing in the floor's sample, slowed the floor (5.6–6.1 ms against 4.7–5.6 ms
# with this pause; the ratio 2.18–2.51x against 2.79–3.16x). An agent's starts are seconds
# apart, so the daemon's sample does not gain from the pause either.
SETTLE_S = 0.03


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
                await trio.sleep(SETTLE_S)
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
    return time_ratio_result(NAME, measured, floor, TARGET, meter.per_op(samples))
