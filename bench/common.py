"""Shared pieces of the benchmark suite: the run mode, timers and statistics, the report
line, the floor server (a subprocess), the daemon (a subprocess), and a lean call loop.

Every speed figure is a ratio against a floor measured in the same run; floor and daemon
samples are interleaved so that drift on the machine affects both alike.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import trio_websocket

from sandbox_supervisor.testing.client import ControlClient, ControlSession, Endpoint, open_websocket
from sandbox_supervisor.testing.daemon import DaemonLayout, DaemonProcess, RunningDaemon, make_layout, running_daemon

BENCH_DIR = Path(__file__).resolve().parent
FLOOR_SERVER = BENCH_DIR / "floor_server.py"
FRAME_TIMEOUT_S = 60.0
ACK_EVERY = 64  # the lean client acks like a control plane would: in batches, not per event

now = time.perf_counter
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Rows that time the daemon against a floor or a peer one operation at a time alternate them
# in blocks of this many kept samples (`alternate`), and the first sample of each block is
# not kept: what one side leaves running after an operation (the daemon starts its next idle
# shell once a command has exited) then lands in its own next sample, never in the other
# side's, whichever way the two are ordered.
ALTERNATE_BLOCK = 20


# --- mode --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    quick: bool = False

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full


# --- alternation -------------------------------------------------------------------------


async def alternate(
    samples: int,
    warmup: int,
    first: Callable[[], Awaitable[float]],
    second: Callable[[], Awaitable[float]],
    measuring: Callable[[], None],
) -> tuple[list[float], list[float], int]:
    """`samples` kept times of each of `first` and `second` (each does one operation and
    returns its time), after `warmup` of each, in alternating blocks of ALTERNATE_BLOCK (the
    first of each block not kept). `measuring` is called once the warm-up is over (to start
    a CPU meter). Returns both lists and how many operations each side did after the warm-up
    (kept or not), the count to divide that meter's CPU by."""
    for _ in range(warmup):
        await first()
        await second()
    measuring()
    firsts: list[float] = []
    seconds: list[float] = []
    done = 0
    while len(seconds) < samples:
        block = min(ALTERNATE_BLOCK, samples - len(seconds))
        for kept, operation in ((firsts, first), (seconds, second)):
            await operation()  # the seam: not kept
            for _ in range(block):
                kept.append(await operation())
        done += block + 1
    return firsts, seconds, done


# --- statistics and the report line ------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latency(samples: list[float]) -> str:
    """"median 1.234 ms p99 2.345 ms (n=200)" of durations in seconds."""
    return (
        f"median {statistics.median(samples) * 1e3:.3f} ms "
        f"p99 {percentile(samples, 99) * 1e3:.3f} ms (n={len(samples)})"
    )


class Skipped(Exception):
    """A benchmark that cannot run on this install (its peer is not installed). run.py prints
    `BENCH <name> SKIP: <reason>` and goes on; a skip is not an error."""


@dataclass
class Result:
    name: str
    measured: str  # what the daemon did, e.g. "median 2.4 ms p99 3.1 ms (n=200)"
    floor: str  # the same for the floor (or for the peer, see floor_label)
    ratio: float  # daemon / floor (times), or daemon rate / floor rate (rates)
    target: str  # e.g. "<= 2.5x"
    passed: bool
    note: str = ""
    # What the verdict judges, when it is not the ratio (an absolute target: idle_rss's MiB),
    # and its unit; run.py takes the median of this over repeated runs.
    figure: float | None = None
    figure_unit: str = "x"
    floor_label: str = "floor"  # "SWE-ReX" for the rows measured against the peer

    @property
    def judged(self) -> float:
        return self.ratio if self.figure is None else self.figure

    def format_figure(self, value: float) -> str:
        return f"{value:.2f}x" if self.figure_unit == "x" else f"{value:.1f} {self.figure_unit}"

    def line(self, label: str = "BENCH", repeats: str = "") -> str:
        verdict = "PASS" if self.passed else "MISS"
        text = (
            f"{label} {self.name:<17} {self.measured} | {self.floor_label} {self.floor} | "
            f"ratio {self.ratio:.2f}x | target {self.target} | {verdict}"
        )
        if repeats:
            text += f" | {repeats}"
        return f"{text} | {self.note}" if self.note else text

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "floor": self.floor,
            "floor_label": self.floor_label,
            "ratio": self.ratio,
            "figure": self.judged,
            "figure_unit": self.figure_unit,
            "target": self.target,
            "passed": self.passed,
            "note": self.note,
        }


def time_ratio_result(name: str, measured: list[float], floor: list[float], limit: float, note: str = "") -> Result:
    """Latency benchmarks: ratio of medians, target `ratio <= limit`."""
    ratio = statistics.median(measured) / statistics.median(floor)
    return Result(name, latency(measured), latency(floor), ratio, f"<= {limit:g}x", ratio <= limit, note)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (/proc/PID/stat, clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class CpuMeter:
    """CPU time spent by the daemon and by the floor server over a whole sample loop.

    Floor and daemon samples alternate and each process only works on its own samples, so
    each process's CPU over the loop, divided by its operations, is its CPU per operation
    (excluding child processes such as the shells it spawns).
    """

    def __init__(self, daemon_pid: int, floor_pid: int | None = None, floor_name: str = "floor") -> None:
        self.pids = {"daemon": daemon_pid, floor_name: floor_pid}
        self.start = {name: cpu_seconds(pid) for name, pid in self.pids.items() if pid is not None}
        self.used: dict[str, float] = {}

    def stop(self) -> None:
        self.used = {name: cpu_seconds(self.pids[name]) - started for name, started in self.start.items()}

    def per_op(self, operations: int, unit: str = "us") -> str:
        scale = {"us": 1e6, "ms": 1e3}[unit]
        parts = [f"{name} {used / operations * scale:.0f} {unit}" for name, used in self.used.items()]
        return "server CPU/op: " + ", ".join(parts)


# --- the floor server --------------------------------------------------------------------


class FloorServer:
    """bench/floor_server.py in a subprocess; `endpoint` is its loopback address."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc = proc
        self.endpoint = Endpoint(tcp=("127.0.0.1", port))

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[trio_websocket.WebSocketConnection]:
        """A WebSocket to the floor, opened exactly as the reference client opens the
        daemon's (testing.client.open_websocket: same buffers and limits)."""
        async with open_websocket(self.endpoint, "/floor", []) as ws:
            yield ws


@asynccontextmanager
async def floor_server() -> AsyncIterator[FloorServer]:
    proc = subprocess.Popen(
        [sys.executable, str(FLOOR_SERVER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
    )
    try:
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        if not line.strip():
            raise RuntimeError(f"the floor server did not start (exit {proc.wait()})")
        yield FloorServer(proc, int(line))
    finally:
        proc.stdin.close()  # it exits when its stdin closes
        try:
            await trio.to_thread.run_sync(proc.wait, 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def echo(ws: trio_websocket.WebSocketConnection, text: str) -> Any:
    """One echo round trip; the answer is parsed as the daemon's answers are."""
    await ws.send_message(text)
    return json.loads((await ws.get_message())[1:])


def echo_text(frame: dict) -> str:
    """An echo message carrying `frame` (the same JSON a daemon call would carry)."""
    return "E" + json.dumps(frame, separators=(",", ":"))


# --- the daemon --------------------------------------------------------------------------


@asynccontextmanager
async def daemon(
    root: Path, *, env: dict[str, str] | None = None, **settings: dict[str, Any]
) -> AsyncIterator[tuple[DaemonProcess, RunningDaemon]]:
    """`python -m sandbox_supervisor.daemon serve` on fresh directories under `root` (as in production:
    its own process and event loop); SIGTERM on leaving (SIGKILL if that times out). On a
    failure the end of its log goes to stderr. `env` is added to the daemon's environment."""
    layout = make_layout(root, **settings)
    try:
        async with running_daemon(layout, env=env) as process:
            yield process, process.running
    except BaseException:
        log = layout.log_file.read_text(errors="replace") if layout.log_file.exists() else ""
        sys.stderr.write(f"--- daemon log ({layout.log_file}) ---\n{log[-4000:]}\n")
        raise


def workspace(layout: DaemonLayout) -> str:
    return str(layout.workspace)


def premint(client: ControlClient, ack_floor: int | None = None) -> dict[str, Any]:
    """Arguments for `client.connect(**…)` with the assertion already signed, so that the
    client's own ES256 signing stays outside the timed region (the daemon's verification
    is inside it)."""
    generation = client.state.generation + 1
    attempt_id = f"attempt-{uuid.uuid4()}"
    ack = client.state.ack_floor if ack_floor is None else ack_floor
    token = client.mint(generation=generation, attempt_id=attempt_id, ack_floor=ack)
    return {"generation": generation, "attempt_id": attempt_id, "ack_floor": ack, "assertion": token}


class Driver:
    """A lean call loop over a ControlSession.

    `ControlSession.result()` looks the answer up in every event stored so far, which costs
    O(events) per call on the client; over thousands of calls that would be measured as the
    daemon's time. This loop sends with `ControlSession.call` and reads frames itself, keeping
    only the highest seq, and acks every ACK_EVERY events (outside any timed region).
    """

    def __init__(self, session: ControlSession) -> None:
        self.session = session
        self.max_seq = 0
        self.acked = 0

    async def call(self, tool_name: str, parameters: dict, *, key: str | None = None) -> dict:
        call_id = await self.session.call(tool_name, parameters, idempotency_key=key)
        return await self.wait_result(call_id)

    async def wait_result(self, call_id: str) -> dict:
        ws = self.session.ws
        with trio.fail_after(FRAME_TIMEOUT_S):
            while True:
                frame = json.loads(await ws.get_message())
                seq = frame.get("seq")
                if seq is not None and seq > self.max_seq:
                    self.max_seq = seq
                kind = frame["kind"]
                if kind == "tool.result" and frame["body"]["call_id"] == call_id:
                    return frame["body"]
                if kind == "error":
                    raise RuntimeError(f"error frame: {frame['body']}")

    async def maybe_ack(self) -> None:
        if self.max_seq - self.acked >= ACK_EVERY:
            await self.session.ack(self.max_seq)
            self.acked = self.max_seq


def require_ok(body: dict) -> dict:
    if not body.get("ok"):
        raise RuntimeError(f"tool call failed: {body.get('error')}")
    return body["result"]


def key() -> str:
    return f"bench-{uuid.uuid4()}"
