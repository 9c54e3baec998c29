"""10 MB of output delivered: a command printing 10 MB, run and read back whole, against
SWE-ReX's `execute` returning the same 10 MB as its stdout.

Daemon: `execute_shell_command` of `yes '<62 chars>' | head -c 10000000` on one bootstrapped
socket, until its `tool.result` (the live `exec.output` events that arrive before it are
received and dropped, as a client that pages would), then every byte of stdout read back with
`exec.read_output` binary pages (`"format": "binary"`, docs/protocol.md §6.5.1) of 1 MiB,
4 requests in flight (a new one sent as each page arrives), each page's bytes copied into
place. The bytes are checked against the command's
output after the timer stops, and the sample's spool is then removed, as `big_output` removes
its own: a spool left in place grows the page cache by 10 MB a sample, and on this benchmark's
VM the first touch of page-cache memory that had not been used for a while is slow, while
SWE-ReX's answer reuses its own heap. Measured with 3 GB of unrelated files in the page cache
(40 samples): call → result 45.3 ms with every spool kept, 19.3 ms with each one removed; on
a machine just emptied of them, 19.2 and 18.7 ms. A sandbox's spools are bounded
(`exec.spool_total_max_bytes`, the oldest pruned), so in a long session its page cache is
recycled too (bench/README.md, "the page cache"). The removal is the benchmark's, so neither
side's CPU figure counts it (a daemon's own prune would be its CPU); its time is out of both.

Peer: SWE-ReX's server (bench/swerex_peer.py) on 127.0.0.1, one keep-alive HTTP connection,
`POST /execute` of the same command as `["/bin/bash", "-c", command]`, until its JSON answer is
received and parsed (stdout as one string), checked the same way.

Samples alternate in blocks (peer, daemon, …: `common.alternate`). The ratio is SWE-ReX's
median over the daemon's (higher is better); the target is SWE-ReX taking at least 2× the
daemon's time. Without swe-rex (the `bench` extra) the daemon's side still runs, and the SKIP
line gives its figure.

Binary pages are what a client that pages a large output should use: base64 JSON pages of 64
KiB cost the daemon about four times the CPU per byte (bench/README.md, "Issue 12:
`apply_file_patch` and output delivery").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import trio

from bench.common import FRAME_TIMEOUT_S, Driver, Mode, Result, Skipped, daemon, key, latency, now, require_ok, workspace
from sandbox_supervisor.daemon.runtime.spool import remove_spool
from sandbox_supervisor.protocol.frames import MAX_BINARY_OUTPUT_PAGE_LENGTH

from bench.swerex_peer import MISSING, alternated, available, compared

NAME = "output_10mb"
TARGET = 2.0  # SWE-ReX's time / the daemon's, at least
SIZE = 10_000_000
PAGE_BYTES = MAX_BINARY_OUTPUT_PAGE_LENGTH  # exec.read_output's largest binary page
IN_FLIGHT = 4
HEADER_LENGTH_BYTES = 4  # a binary page's big-endian header length (§6.5.1)
LINE = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
COMMAND = f"yes '{LINE}' | head -c {SIZE}"
ARGV = ["/bin/bash", "-c", COMMAND]


def expected_output() -> bytes:
    line = (LINE + "\n").encode()
    return (line * (SIZE // len(line) + 1))[:SIZE]


class Paged(NamedTuple):
    call_id: str
    out: bytearray


async def delivered(driver: Driver) -> Paged:
    """Run the command and page its stdout back; the call and the bytes read."""
    session = driver.session
    call_id = await session.call("execute_shell_command", {"command": COMMAND, "timeout_ms": 60_000}, idempotency_key=key())
    result = require_ok(await driver.wait_result(call_id))
    assert result["exit_code"] == 0, result
    total = result["stdout"]["bytes"]
    out = bytearray(total)
    pending: dict[int, int] = {}  # offset -> length of each request in flight
    next_offset = 0
    received = 0

    async def ask(offset: int, length: int) -> None:
        pending[offset] = length
        await session.send(
            "exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": offset, "length": length, "format": "binary"}
        )

    while next_offset < total and len(pending) < IN_FLIGHT:
        await ask(next_offset, min(PAGE_BYTES, total - next_offset))
        next_offset += PAGE_BYTES
    with trio.fail_after(FRAME_TIMEOUT_S):
        while received < total:
            message = await session.ws.get_message()
            if isinstance(message, str):
                frame = json.loads(message)
                if frame["kind"] == "error":
                    raise RuntimeError(f"error frame: {frame['body']}")
                continue  # a live event of this or an earlier call
            end = HEADER_LENGTH_BYTES + int.from_bytes(message[:HEADER_LENGTH_BYTES], "big")
            body = json.loads(message[HEADER_LENGTH_BYTES:end])["body"]
            offset = body["offset"]
            data = memoryview(message)[end:]
            out[offset:offset + len(data)] = data
            received += len(data)
            asked = pending.pop(offset)
            if len(data) < asked:  # the spool was behind: ask again for the rest of this page
                await ask(offset + len(data), asked - len(data))
            elif next_offset < total:
                await ask(next_offset, min(PAGE_BYTES, total - next_offset))
                next_offset += PAGE_BYTES
    await driver.maybe_ack()
    return Paged(call_id, out)


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(15, 2), 1
    expected = expected_output()
    if not available():
        alone = await daemon_alone(workdir, samples, warmup, expected)
        raise Skipped(f"{MISSING}; the daemon alone: {latency(alone)}")

    def check_peer(answer: dict) -> None:
        assert answer["exit_code"] == 0 and answer["stdout"].encode() == expected, "SWE-ReX's stdout differs"

    def check_daemon(paged: Paged) -> None:
        assert paged.out == expected, "the paged stdout differs from the command's output"

    def remove_sample_spool(state_dir: Path, paged: Paged) -> None:
        remove_spool(state_dir, paged.call_id)

    measured, peer, meter, done = await alternated(
        workdir, samples, warmup, lambda http: http.execute(ARGV), delivered, check_peer, check_daemon, remove_sample_spool
    )
    return compared(NAME, TARGET, measured, peer, f"{SIZE // 1_000_000} MB, pages of {PAGE_BYTES // 1024} KiB, {IN_FLIGHT} in flight; {meter.per_op(done, 'ms')}")


async def daemon_alone(workdir: Path, samples: int, warmup: int, expected: bytes) -> list[float]:
    measured: list[float] = []
    async with daemon(workdir / "daemon") as (_process, running):
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                started = now()
                paged = await delivered(driver)
                elapsed = now() - started
                assert paged.out == expected, "the paged stdout differs from the command's output"
                remove_spool(running.layout.state_dir, paged.call_id)
                if i >= warmup:
                    measured.append(elapsed)
    return measured
