"""3. `apply_file_patch`: a small edit (one line, 3 lines of context) to a 100 KB file.

Daemon: a `tool.call` with a unified diff and the file's base sha, until `tool.result`
(the daemon plans the patch against the sha, records its intent, writes a temporary file,
fsyncs, renames, fsyncs the directory, and journals the result).

Floor: on one socket to the floor server, a message on which the server edits one byte of
its in-memory copy of an identical 100 KB file and writes it atomically (temporary file,
write, fsync, rename, fsync of the directory) in its own process, then answers: the atomic
write plus one round trip. Both files live in the same directory tree (same file system).

The diff and the base sha are prepared before the timer starts (client work).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from bench.common import CpuMeter, Driver, Mode, Result, daemon, floor_server, key, now, require_ok, time_ratio_result, workspace

NAME = "patch_small_edit"
TARGET = 1.5
LINE_CHARS = 63  # + "\n" = 64 bytes a line
LINES = 1600  # 102,400 bytes


def blob_sha(data: bytes) -> str:
    digest = hashlib.sha1(b"blob %d\0" % len(data))
    digest.update(data)
    return digest.hexdigest()


def make_lines() -> list[str]:
    return [f"{i:06d} " + "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstu"[: LINE_CHARS - 7] + "\n" for i in range(LINES)]


def one_line_diff(path: str, lines: list[str], index: int, new_line: str) -> str:
    """A unified diff replacing lines[index] (0-based), with 3 lines of context."""
    start = max(0, index - 3)
    end = min(len(lines), index + 4)
    out = [f"--- a/{path}\n", f"+++ b/{path}\n", f"@@ -{start + 1},{end - start} +{start + 1},{end - start} @@\n"]
    for i in range(start, end):
        if i == index:
            out.append("-" + lines[i])
            out.append("+" + new_line)
        else:
            out.append(" " + lines[i])
    return "".join(out)


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(300, 10), mode.pick(10, 2)
    measured: list[float] = []
    floor: list[float] = []
    lines = make_lines()
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        ws_root = running.layout.workspace
        (ws_root / "big.txt").write_text("".join(lines))
        floor_file = ws_root / "floor" / "big.txt"  # same file system, its own directory
        floor_file.parent.mkdir()
        floor_file.write_text("".join(lines))
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid, fs.proc.pid)
                index = LINES // 2
                old = lines[index]
                new = old[:-2] + ("x" if old[-2] != "x" else "y") + "\n"
                params = {
                    "path": "big.txt",
                    "diff": one_line_diff("big.txt", lines, index, new),
                    "base_sha": blob_sha("".join(lines).encode()),
                }
                started = now()
                await ws.send_message("W" + str(floor_file))
                await ws.get_message()
                elapsed_floor = now() - started
                started = now()
                body = await driver.call("apply_file_patch", params, key=key())
                elapsed = now() - started
                result = require_ok(body)
                lines[index] = new
                assert result["hunks"] == 1, result
                await driver.maybe_ack()
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
        assert (ws_root / "big.txt").read_text() == "".join(lines)
    return time_ratio_result(NAME, measured, floor, TARGET, meter.per_op(samples))
