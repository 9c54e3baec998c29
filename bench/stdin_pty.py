"""9. Stdin round trip through a terminal: write one line to `cat` on a PTY, receive its echo.

Daemon: `start_process` of `cat` with a `pty` once; then, on the bootstrapped socket, an
`exec.write_stdin` of one line at the next offset, until the `exec.output` events of that
process hold both line ends it produces (the terminal's echo and cat's copy). The path: the
socket, the daemon, the holder's control socket, the terminal, the holder's spool write, the
daemon's read of the spool, a journal commit, the socket.

Floor: on one socket to the floor server, a message the server writes to its own `cat` on a
terminal, answering with what the terminal gives back: a bare PTY echo behind a
trio-websocket server.

The note adds the holder's CPU per keystroke to the daemon's and the floor server's: the
daemon's side of a keystroke is both processes' work.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from bench.common import CpuMeter, Mode, Result, cpu_seconds, daemon, floor_server, key, now, time_ratio_result, workspace
from sandbox_supervisor.daemon.runtime.holder_protocol import HOLDER_FILE
from sandbox_supervisor.daemon.runtime.spool import spool_dir

NAME = "stdin_pty"
TARGET = 2.0
LINE = "x\n"
DATA = base64.b64encode(LINE.encode()).decode()


async def run(mode: Mode, workdir: Path) -> Result:
    samples, warmup = mode.pick(300, 10), mode.pick(20, 2)
    measured: list[float] = []
    floor: list[float] = []
    async with floor_server() as fs, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with fs.connect() as ws, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            call_id = await session.call("start_process", {"command": "cat", "pty": {"rows": 24, "cols": 80}}, idempotency_key=key())
            result = await session.result(call_id)
            assert result["ok"], result
            holder = json.loads((spool_dir(running.layout.state_dir, call_id) / HOLDER_FILE).read_text())
            holder_pid = holder["holder_pid"]
            offset = 0
            expected = seen = 0  # line ends of the process's output: wanted, and received so far
            for i in range(warmup + samples):
                if i == warmup:
                    meter = CpuMeter(process.proc.pid, fs.proc.pid)
                    holder_cpu = cpu_seconds(holder_pid)
                started = now()
                await ws.send_message("T" + LINE)
                await ws.get_message()
                elapsed_floor = now() - started
                started = now()
                await session.send("exec.write_stdin", {"call_id": call_id, "offset": offset, "data": DATA})
                offset += len(LINE)
                expected += 2
                while seen < expected:
                    frame = await session.ws.get_message()  # raw text: no parse in the timed loop
                    if '"exec.output"' in frame and call_id in frame:
                        seen += frame.count("\\n")  # JSON's escaped line ends
                elapsed = now() - started
                if i >= warmup:
                    floor.append(elapsed_floor)
                    measured.append(elapsed)
            meter.stop()
            holder_cpu = cpu_seconds(holder_pid) - holder_cpu
            await session.send("exec.signal", {"call_id": call_id, "signal": "SIGKILL"})
    note = f"{meter.per_op(samples)}, holder {holder_cpu / samples * 1e6:.0f} us"
    return time_ratio_result(NAME, measured, floor, TARGET, note)
