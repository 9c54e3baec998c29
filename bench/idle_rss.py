"""7. Idle RSS of the daemon process, against a bare Python importing the same libraries.

Daemon: `python -m supervisor serve` started, one connection bootstrapped (and closed), then
VmRSS from /proc/PID/status after a short settle.

Floor: a fresh `python -c "import trio, trio_websocket, pydantic, cryptography, joserfc,
structlog, prometheus_client"` (the same interpreter) reading its own VmRSS; the median of 3.

The target is absolute (<= 60 MiB); the ratio daemon / bare and the difference are reported.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import trio

from bench.common import Mode, Result, daemon, workspace

NAME = "idle_rss"
TARGET_MIB = 60
SETTLE_S = 0.5
LIBRARIES = ("trio", "trio_websocket", "pydantic", "cryptography", "joserfc", "structlog", "prometheus_client")
BARE = (
    f"import {', '.join(LIBRARIES)}\n"
    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')))\n"
)


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def bare_rss_kib() -> int:
    return int(subprocess.run([sys.executable, "-c", BARE], check=True, capture_output=True, text=True).stdout)


async def run(mode: Mode, workdir: Path) -> Result:
    async with daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
        await trio.sleep(SETTLE_S)
        daemon_kib = vm_rss_kib(process.proc.pid)
    bare_kib = statistics.median([await trio.to_thread.run_sync(bare_rss_kib) for _ in range(3)])
    daemon_mib, bare_mib = daemon_kib / 1024, bare_kib / 1024
    return Result(
        NAME,
        f"daemon VmRSS {daemon_mib:.1f} MiB",
        f"bare imports {bare_mib:.1f} MiB",
        daemon_mib / bare_mib,
        f"<= {TARGET_MIB} MiB absolute",
        daemon_mib <= TARGET_MIB,
        f"difference {daemon_mib - bare_mib:+.1f} MiB",
    )
