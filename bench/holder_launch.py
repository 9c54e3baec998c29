"""8. Starting a process through its holder: `launch_holder` → holder.json, and → first output.

Holder: `launch_holder` of `true` (the call returns once holder.json is written: the holder's
interpreter has started, the process is spawned and exec succeeded); then `echo hi`, until
its `hi` is in the spool's stdout file. The memory of a holder (of `sleep`) is in the note:
VmRSS, and its private part (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), since
the interpreter's shared pages are paid once for all holders.

Floor: a bare `python -I -c pass` of the same interpreter, start to exit: the part of a
launch that no holder written in Python can avoid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import trio

from bench.common import Mode, Result, latency, now, time_ratio_result

from sandbox_supervisor.daemon.runtime.holder_launch import launch_holder
from sandbox_supervisor.daemon.runtime.holder_protocol import EXIT_FILE, HolderSpec

NAME = "holder_launch"
TARGET = 2.0
FIRST_OUTPUT_TIMEOUT_S = 10.0
POLL_S = 0.0002
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def _spec(*argv: str) -> HolderSpec:
    return HolderSpec(argv=argv, cwd="/", env=ENV, stdin="null")


def _first_output(directory: Path, expected: bytes) -> None:
    path = directory / "stdout"
    deadline = time.monotonic() + FIRST_OUTPUT_TIMEOUT_S
    while True:
        try:
            if path.read_bytes() == expected:
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no output in {path}")
        time.sleep(POLL_S)


def _memory_kib(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    private = 0
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1])
    return rss, private


def _measure(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(40, 3), mode.pick(3, 1)
    to_holder_json: list[float] = []
    to_first_output: list[float] = []
    floor: list[float] = []
    for i in range(warmup + samples):
        started = now()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        elapsed_floor = now() - started
        started = now()
        launch_holder(workdir / str(uuid.uuid4()), _spec("true"))
        elapsed = now() - started
        directory = workdir / str(uuid.uuid4())
        started = now()
        launch_holder(directory, _spec("echo", "hi"))
        _first_output(directory, b"hi\n")
        elapsed_output = now() - started
        if i >= warmup:
            floor.append(elapsed_floor)
            to_holder_json.append(elapsed)
            to_first_output.append(elapsed_output)
    idle = launch_holder(workdir / str(uuid.uuid4()), _spec("sleep", "30"))
    try:
        time.sleep(0.2)
        rss, private = _memory_kib(idle.holder_pid)
    finally:
        os.killpg(idle.pgid, signal.SIGKILL)
    for directory in workdir.iterdir():  # every holder is gone before the directory is
        deadline = time.monotonic() + FIRST_OUTPUT_TIMEOUT_S
        while not (directory / EXIT_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    note = (
        f"to first output (echo hi) {latency(to_first_output)}; "
        f"holder VmRSS {rss / 1024:.1f} MiB, private {private / 1024:.1f} MiB"
    )
    return time_ratio_result(NAME, to_holder_json, floor, TARGET, note)


async def run(mode: Mode, workdir: Path) -> Result:
    workdir.mkdir(parents=True, exist_ok=True)
    return await trio.to_thread.run_sync(_measure, mode, workdir)
