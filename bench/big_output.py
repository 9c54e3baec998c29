"""5. A command printing N MB (200 MB; --quick 20 MB), call → result with the spool complete.

Daemon: `execute_shell_command` of `yes '<62 chars>' | head -c N`, from the call until its
`tool.result` has arrived and the spool's stdout is sealed (`stdout.state`: ended, all N bytes
kept). The spool cap is raised above N for this run (`exec.spool_max_bytes`), otherwise the
daemon would keep only 64 MiB by design.

Floor: the same command piped through `cat` into a file (`bash -c "<cmd> | cat > file"`,
spawned with trio from the benchmark process), spawn to exit.

Throughput is N / time; the ratio is daemon throughput / floor throughput (higher is
better). Each spool file and floor file is deleted after its sample.
"""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import trio

from bench.common import FRAME_TIMEOUT_S, CpuMeter, Driver, Mode, Result, daemon, key, now, require_ok, workspace
from sandbox_supervisor.daemon.runtime.spool import remove_spool, spool_dir

NAME = "big_output"
TARGET = 0.9
MB = 1_000_000


def command(size: int) -> str:
    return f"yes 'abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ' | head -c {size}"


def throughput(size: int, samples: list[float]) -> str:
    rates = [size / s / 1e9 for s in samples]
    return f"median {statistics.median(rates):.2f} GB/s (min {min(rates):.2f}, n={len(rates)})"


async def run(mode: Mode, workdir: Path) -> Result:
    size = mode.pick(200, 20) * MB
    samples, warmup = mode.pick(7, 2), 1
    measured: list[float] = []
    floor: list[float] = []
    waited_for_spool = 0
    async with daemon(workdir / "daemon", exec={"spool_max_bytes": size + MB}) as (process, running):
        state_dir = running.layout.state_dir
        floor_file = workdir / "floor.out"
        floor_argv = ["bash", "-c", f"{command(size)} | cat > {shlex.quote(str(floor_file))}"]
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid)
                started = now()
                await trio.run_process(floor_argv)
                elapsed_floor = now() - started
                assert floor_file.stat().st_size == size
                floor_file.unlink()

                started = now()
                call_id = await session.call(
                    "execute_shell_command", {"command": command(size), "timeout_ms": 60000}, idempotency_key=key()
                )
                body = await driver.wait_result(call_id)
                state_path = spool_dir(state_dir, call_id) / "stdout.state"
                with trio.fail_after(FRAME_TIMEOUT_S):
                    while True:  # the result normally comes after the spool is sealed
                        try:
                            state = json.loads(state_path.read_text())
                        except FileNotFoundError:
                            state = {"ended": False}
                        if state["ended"]:
                            break
                        waited_for_spool += 1
                        await trio.sleep(0.001)
                elapsed = now() - started
                result = require_ok(body)
                assert result["exit_code"] == 0 and result["stdout"]["bytes"] == size, result
                assert state["kept"] == size and not state["truncated"], state
                remove_spool(state_dir, call_id)
                await driver.maybe_ack()
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
    ratio = statistics.median(floor) / statistics.median(measured)  # = throughput ratio
    note = f"{size // MB} MB; daemon CPU {meter.used['daemon'] / samples * 1e3:.0f} ms per command"
    if waited_for_spool:
        note += f"; the spool was sealed after the result ({waited_for_spool} polls)"
    return Result(NAME, throughput(size, measured), throughput(size, floor), ratio, f">= {TARGET:g}x", ratio >= TARGET, note)
