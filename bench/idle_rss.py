"""7. Idle RSS of the daemon process, against a bare Python importing the same libraries.

Daemon: `python -m sandbox_supervisor.daemon serve` started, one connection bootstrapped (and closed), then
VmRSS from /proc/PID/status after a short settle.

Floor: a fresh Python (the same interpreter) that imports the six libraries the daemon
depends on — trio, wsproto, pydantic, cryptography, structlog, prometheus_client —
and reads its own VmRSS; the median of 3. (joserfc, which the daemon imported until it
checked the ES256 signature with cryptography itself, and trio-websocket, whose server it
used until its control sockets became its own, are no longer among them.) `import pydantic` and
`import cryptography` alone load almost nothing (pydantic is lazy; cryptography's EC
backend is a separate extension module), so the floor imports the names the daemon itself
imports from them (BaseModel/TypeAdapter, hazmat EC); the figure for bare
top-level imports is reported in the note as well.

The target is absolute (<= 55 MiB); the ratio daemon / floor and the difference are reported.

`rich` is hidden from both when it is installed: the `bench` extra brings it (SWE-ReX needs
it), and structlog imports it whenever it can (for its development console renderer), which
adds about 4 MiB to the daemon and to the floor alike. An install from constraints.txt has no
rich; the note says when it was hidden. A directory put first on PYTHONPATH holds a `rich`
package whose import fails, as it would without the package.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path

import trio

from bench.common import Mode, Result, daemon, workspace

NAME = "idle_rss"
TARGET_MIB = 55
SETTLE_S = 0.5
REPEATS = 3
TOP_LEVEL = "import trio, wsproto, pydantic, cryptography, structlog, prometheus_client\n"
AS_USED = TOP_LEVEL + (
    "from pydantic import BaseModel, TypeAdapter\n"
    "from cryptography.hazmat.primitives import hashes\n"
    "from cryptography.hazmat.primitives.asymmetric import ec\n"
    "from prometheus_client import CollectorRegistry\n"
)
PRINT_RSS = "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')))\n"


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


HIDDEN = ("rich",)  # importable only through the bench extra; structlog loads it when it can


def hiding_env(workdir: Path) -> dict[str, str]:
    """PYTHONPATH for a process that must not find the HIDDEN packages ({} when none is
    installed)."""
    hidden = [name for name in HIDDEN if importlib.util.find_spec(name) is not None]
    if not hidden:
        return {}
    shim = workdir / "hide-packages"
    for name in hidden:
        (shim / name).mkdir(parents=True, exist_ok=True)
        (shim / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden from this benchmark')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH", "")]))}


def bare_rss_mib(imports: str, env: dict[str, str]) -> float:
    def once() -> int:
        out = subprocess.run(
            [sys.executable, "-c", imports + PRINT_RSS], check=True, capture_output=True, text=True, env={**os.environ, **env}
        )
        return int(out.stdout)

    return statistics.median(once() for _ in range(REPEATS)) / 1024


async def run(mode: Mode, workdir: Path) -> Result:
    env = hiding_env(workdir)
    async with daemon(workdir / "daemon", env=env) as (process, running):
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
        await trio.sleep(SETTLE_S)
        daemon_mib = vm_rss_kib(process.proc.pid) / 1024
    bare_mib = await trio.to_thread.run_sync(bare_rss_mib, AS_USED, env)
    top_level_mib = await trio.to_thread.run_sync(bare_rss_mib, TOP_LEVEL, env)
    return Result(
        NAME,
        f"daemon VmRSS {daemon_mib:.1f} MiB",
        f"bare imports {bare_mib:.1f} MiB",
        daemon_mib / bare_mib,
        f"<= {TARGET_MIB} MiB absolute",
        daemon_mib <= TARGET_MIB,
        f"difference {daemon_mib - bare_mib:+.1f} MiB; top-level imports only {top_level_mib:.1f} MiB"
        + ("; rich hidden (installed by the bench extra)" if env else ""),
        figure=daemon_mib,
        figure_unit="MiB",
    )
