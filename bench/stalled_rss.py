"""The daemon's memory while a stalled client gets 1 GB of output (--quick 100 MB).

A client bootstraps, runs one 10 MB command to the end (so the output path is warm), acks
everything, then calls `execute_shell_command` of `yes '<62 chars>' | head -c 1000000000` and
never reads its socket again: its WebSocket library stops reading once its 8-message queue is
full, the kernel's buffers fill, and the daemon's sends to it block. The command's output must
still flow (to the spool, whose cap keeps 64 MiB of it by default) without the daemon holding
it in memory for the stalled client.

Measured: the daemon's VmRSS just before the call (the baseline), polled every POLL_S until
the command's stdout is sealed in the spool (`stdout.state`: ended), and its VmHWM (peak)
before and after; the growth is the peak over the baseline. The target is absolute: at most
16 MiB of growth. The ratio shown is peak / baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio

from bench.common import Driver, Mode, Result, daemon, key, require_ok, workspace
from sandbox_supervisor.daemon.runtime.spool import spool_dir

NAME = "stalled_rss"
TARGET_MIB = 16
POLL_S = 0.02
SETTLE_S = 0.5
STALL_DEADLINE_S = 120.0  # 1 GB through a pipe and a spool takes a few seconds; far more when busy
COMMAND_TIMEOUT_MS = 60_000  # execute_shell_command's longest timeout
CLOSE_S = 10.0
MB = 1_000_000
LINE = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def command(size: int) -> str:
    return f"yes '{LINE}' | head -c {size}"


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


async def run(mode: Mode, workdir: Path) -> Result:
    size = mode.pick(1000, 100) * MB
    polls = 0
    sealed = False
    async with daemon(workdir / "daemon") as (process, running):
        pid = process.proc.pid
        state_dir = running.layout.state_dir
        client = running.client()
        with trio.move_on_after(STALL_DEADLINE_S) as scope:
            async with client.connect() as session:
                await session.bootstrap(cwd=workspace(running.layout))
                driver = Driver(session)
                warm = await driver.call("execute_shell_command", {"command": command(10 * MB)}, key=key())
                assert require_ok(warm)["exit_code"] == 0, warm
                await session.ack(driver.max_seq)
                await trio.sleep(SETTLE_S)  # let the warm-up's memory settle before the baseline
                baseline = status_kib(pid, "VmRSS")
                hwm_before = status_kib(pid, "VmHWM")
                peak = baseline
                call_id = await session.call(
                    "execute_shell_command",
                    {"command": command(size), "timeout_ms": COMMAND_TIMEOUT_MS},
                    idempotency_key=key(),
                )
                state_path = spool_dir(state_dir, call_id) / "stdout.state"
                while True:  # the socket is never read from here on
                    peak = max(peak, status_kib(pid, "VmRSS"))
                    polls += 1
                    try:
                        if json.loads(state_path.read_text())["ended"]:
                            sealed = True
                            break
                    except (FileNotFoundError, json.JSONDecodeError):
                        pass
                    await trio.sleep(POLL_S)
                peak = max(peak, status_kib(pid, "VmRSS"))
                hwm_after = status_kib(pid, "VmHWM")
                scope.deadline = trio.current_time() + CLOSE_S  # closing a stalled socket may wait
        if not sealed:
            raise RuntimeError(f"the command's output was not all taken within {STALL_DEADLINE_S:g} s")
    if hwm_after > hwm_before:  # a peak between two polls
        peak = max(peak, hwm_after)
    growth_mib = (peak - baseline) / 1024
    return Result(
        NAME,
        f"daemon VmRSS peak {peak / 1024:.1f} MiB while stalled",
        f"{baseline / 1024:.1f} MiB before the call",
        peak / baseline,
        f"<= {TARGET_MIB} MiB growth",
        growth_mib <= TARGET_MIB,
        f"growth {growth_mib:+.1f} MiB over {size // MB:,} MB of output ({polls} polls)",
        figure=growth_mib,
        figure_unit="MiB",
        floor_label="baseline",
    )
