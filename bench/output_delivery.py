"""11. 10 MB of output delivered: a command printing 10 MB, run and read back whole.

Daemon: `execute_shell_command` of `yes '<62 chars>' | head -c 10MB`, from the call until its
`tool.result`, then every byte of stdout paged back with `exec.read_output` as binary pages
(docs/protocol.md §6.5.1) of 1 MiB, 4 requests in flight (`ControlSession.read_stream`); the
bytes are checked to be the command's output. What an agent's control plane does to get a
command's whole output.

Floor: the same command spawned by the benchmark process with trio, its stdout captured
through a pipe (`trio.run_process(..., capture_stdout=True)`): producing and reading the same
10 MB with no daemon, no spool and no socket in between.

The note gives the daemon's time split (call → result, paging) and the same paging as JSON
pages of 64 KiB with base64, 8 in flight: what a client that does not opt in gets.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import trio

from bench.common import CpuMeter, Driver, Mode, Result, daemon, key, now, require_ok, time_ratio_result, workspace
from sandbox_supervisor.protocol.frames import MAX_BINARY_OUTPUT_PAGE_LENGTH, MAX_OUTPUT_PAGE_LENGTH

NAME = "output_delivery"
TARGET = 3.0
MB = 1_000_000
PAGES_IN_FLIGHT = 4
JSON_PAGES_IN_FLIGHT = 8
PAGING_TIMEOUT_S = 60.0


def command(size: int) -> str:
    return f"yes 'abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ' | head -c {size}"


async def run(mode: Mode, workdir: Path) -> Result:
    size = mode.pick(10, 2) * MB
    samples, warmup = mode.pick(9, 2), 1
    measured: list[float] = []
    floor: list[float] = []
    calls: list[float] = []
    paging: list[float] = []
    json_paging: list[float] = []
    expected = b""
    async with daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid)
                started = now()
                produced = await trio.run_process(["bash", "-c", command(size)], capture_stdout=True)
                elapsed_floor = now() - started
                assert len(produced.stdout) == size
                expected = produced.stdout

                started = now()
                call_id = await session.call(
                    "execute_shell_command", {"command": command(size), "timeout_ms": 60000}, idempotency_key=key()
                )
                body = await driver.wait_result(call_id)
                answered = now()
                data, last = await session.read_stream(
                    call_id,
                    "stdout",
                    page_length=MAX_BINARY_OUTPUT_PAGE_LENGTH,
                    in_flight=PAGES_IN_FLIGHT,
                    timeout=PAGING_TIMEOUT_S,
                )
                delivered = now()
                result = require_ok(body)
                assert result["exit_code"] == 0 and result["stdout"]["bytes"] == size, result
                assert data == expected and last["eof"], (len(data), last)
                await driver.maybe_ack()
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(delivered - started)
                    calls.append(answered - started)
                    paging.append(delivered - answered)
                    # Outside the timed region and the CPU figure's loop: the JSON pages.
                    meter_paused = CpuMeter(process.proc.pid)
                    started = now()
                    data, _ = await session.read_stream(
                        call_id,
                        "stdout",
                        page_length=MAX_OUTPUT_PAGE_LENGTH,
                        in_flight=JSON_PAGES_IN_FLIGHT,
                        binary=False,
                        timeout=PAGING_TIMEOUT_S,
                    )
                    json_paging.append(now() - started)
                    meter_paused.stop()
                    meter.start["daemon"] += meter_paused.used["daemon"]
                    assert data == expected
            meter.stop()

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.1f} ms"

    note = (
        f"{size // MB} MB; call -> result {ms(calls)}, paging {ms(paging)} (binary pages of "
        f"{MAX_BINARY_OUTPUT_PAGE_LENGTH // 1024} KiB, {PAGES_IN_FLIGHT} in flight); JSON pages of "
        f"{MAX_OUTPUT_PAGE_LENGTH // 1024} KiB, {JSON_PAGES_IN_FLIGHT} in flight: paging {ms(json_paging)}; "
        f"daemon CPU {meter.used['daemon'] / samples * 1e3:.1f} ms per delivery"
    )
    return time_ratio_result(NAME, measured, floor, TARGET, note)
