"""The p99 of `execute_shell_command` `true` beside 16 chatty commands, against its p99
unloaded, on the same daemon and socket.

Unloaded: calls of `true` one after the other (as `exec_true`), nothing else running.

Loaded: the same calls while 16 other `execute_shell_command` calls of the same session run a
chatty command each: a small Python loop printing an 80-byte line every 10 ms (1,600 lines a
second together), whose live `exec.output` events the daemon journals and sends on the same
socket as the `true` calls' results (the client receives and drops them). Timing starts once
every chatty command has printed; at the end of the block they are told to stop (a file
appears) and their results are awaited. Each ends by itself after CHATTY_MAX_S as well.

Blocks alternate: unloaded, loaded, unloaded, loaded. The ratio is loaded p99 over unloaded
p99 (nearest rank). `exec.max_processes` is raised above the 17 commands that run at once
(the default is 16).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import trio

from bench.common import FRAME_TIMEOUT_S, Driver, Mode, Result, daemon, key, latency, now, percentile, require_ok, workspace

NAME = "p99_loaded"
TARGET = 3.0
CHATTY = 16
CHATTY_INTERVAL_S = 0.01
COMMAND_TIMEOUT_MS = 60_000  # execute_shell_command's longest timeout
CHATTY_MAX_S = 45  # a chatty command ends by itself after this, whatever happens to the run
CHATTY_SCRIPT = f"""\
import os, sys, time
stop = sys.argv[1]
deadline = time.monotonic() + {CHATTY_MAX_S}
n = 0
while time.monotonic() < deadline and not os.path.exists(stop):
    print("chatty %08d " % n + "x" * 64, flush=True)
    n += 1
    time.sleep({CHATTY_INTERVAL_S})
"""


async def true_calls(driver: Driver, count: int, into: list[float] | None) -> None:
    for _ in range(count):
        started = now()
        body = await driver.call("execute_shell_command", {"command": "true"}, key=key())
        elapsed = now() - started
        assert require_ok(body)["exit_code"] == 0, body
        await driver.maybe_ack()
        if into is not None:
            into.append(elapsed)


async def frames_until(driver: Driver, done) -> None:
    """Read frames (keeping the driver's highest seq) until `done(frame)` has said True for
    what it waits for."""
    with trio.fail_after(FRAME_TIMEOUT_S):
        while True:
            frame = json.loads(await driver.session.ws.get_message())
            seq = frame.get("seq")
            if seq is not None and seq > driver.max_seq:
                driver.max_seq = seq
            if frame["kind"] == "error":
                raise RuntimeError(f"error frame: {frame['body']}")
            if done(frame):
                return


async def loaded_block(driver: Driver, command: str, stop_file: Path, count: int, into: list[float]) -> float:
    """Start the chatty commands, time `count` calls of `true` beside them, stop them; the
    rate of events received meanwhile (per second)."""
    stop_file.unlink(missing_ok=True)
    calls = set()
    for _ in range(CHATTY):
        calls.add(await driver.session.call(
            "execute_shell_command", {"command": command, "timeout_ms": COMMAND_TIMEOUT_MS}, idempotency_key=key()
        ))
    printing: set[str] = set()

    def all_printing(frame: dict) -> bool:
        if frame["kind"] == "exec.output" and frame["body"]["call_id"] in calls:
            printing.add(frame["body"]["call_id"])
        if frame["kind"] == "tool.result" and frame["body"]["call_id"] in calls:
            raise RuntimeError(f"a chatty command ended early: {frame['body']}")
        return len(printing) == CHATTY

    await frames_until(driver, all_printing)
    first_seq, started = driver.max_seq, now()
    await true_calls(driver, count, into)
    rate = (driver.max_seq - first_seq) / (now() - started)
    stop_file.touch()
    finished: set[str] = set()

    def all_finished(frame: dict) -> bool:
        if frame["kind"] == "tool.result" and frame["body"]["call_id"] in calls:
            finished.add(frame["body"]["call_id"])
        return finished == calls

    await frames_until(driver, all_finished)
    await driver.maybe_ack()
    return rate


async def run(mode: Mode, workdir: Path) -> Result:
    blocks, per_block, warmup = mode.pick(2, 1), mode.pick(150, 20), mode.pick(20, 2)
    unloaded: list[float] = []
    loaded: list[float] = []
    rates: list[float] = []
    async with daemon(workdir / "daemon", exec={"max_processes": CHATTY + 4}) as (_process, running):
        script = workdir / "chatty.py"
        script.write_text(CHATTY_SCRIPT)
        stop_file = workdir / "chatty.stop"
        command = f"exec {shlex.quote(sys.executable)} -u {shlex.quote(str(script))} {shlex.quote(str(stop_file))}"
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            await true_calls(driver, warmup, None)
            for _ in range(blocks):
                await true_calls(driver, per_block, unloaded)
                rates.append(await loaded_block(driver, command, stop_file, per_block, loaded))
    ratio = percentile(loaded, 99) / percentile(unloaded, 99)
    note = (
        f"{CHATTY} chatty commands, a line every {CHATTY_INTERVAL_S * 1e3:g} ms each; "
        f"{min(rates):,.0f}–{max(rates):,.0f} events/s received while loaded"
    )
    return Result(NAME, latency(loaded), latency(unloaded), ratio, f"<= {TARGET:g}x (p99 / p99)", ratio <= TARGET, note, floor_label="unloaded")
