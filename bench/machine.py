"""Facts of the machine a run depends on, for the report's header.

`cgroup_migration()`: what moving a process into a cgroup costs here after a pause, the cost
every command and every held process pays once for its cgroup (docs/operations.md, "Process
isolation"). The kernel orders migrations against forks and exits with a lock whose writer
waits for an RCU grace period unless another migration ran a moment before, or the
`favordynmods` mount option keeps the lock in the mode that favours migrations: 10–15 ms
against 0.1–0.2 ms on the development machine, which moves `process_start` (and any command
issued after a pause) by as much. The benchmarks themselves issue calls back to back, so
`exec_true` mostly meets the lock still warm.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

# Between two measured moves: longer than an RCU grace period here, so each move starts cold,
# as a command after an agent's pause does.
PAUSE_S = 0.05
SAMPLES = 5
CGROUP_MOUNTS = Path("/proc/self/mounts")


def _writable_hierarchy(mounts_text: str) -> Path | None:
    """A cgroup v2 mount, else the v1 freezer's (the daemon's own choice of hierarchy)."""
    mounts = [line.split() for line in mounts_text.splitlines()]
    v2 = [Path(m[1]) for m in mounts if len(m) > 3 and m[2] == "cgroup2"]
    v1 = [Path(m[1]) for m in mounts if len(m) > 3 and m[2] == "cgroup" and "freezer" in m[3].split(",")]
    for candidate in (*v2, *v1):
        if os.access(candidate / "cgroup.procs", os.W_OK):
            return candidate
    return None


def _one_move(target: Path) -> float:
    """Fork a child that moves itself into `target`; the seconds its write took."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one write, the time taken back (or its errno), and out
        try:
            started = time.perf_counter()
            fd = os.open(target / "cgroup.procs", os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
            os.write(write_end, repr(time.perf_counter() - started).encode())
        except OSError as exc:
            os.write(write_end, f"errno {exc.errno}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        answer = os.read(read_end, 64)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    if answer.startswith(b"errno"):
        raise OSError(int(answer.split()[1]), f"the move into {target} was refused")
    return float(answer)


def cgroup_migration() -> str:
    """The header line's text: the median of SAMPLES moves, each after PAUSE_S, and whether a
    hierarchy is mounted with favordynmods; or why nothing was measured."""
    try:
        mounts_text = CGROUP_MOUNTS.read_text()
    except OSError:
        mounts_text = ""
    hierarchy = _writable_hierarchy(mounts_text)
    if hierarchy is None:
        return "not measured (no writable cgroup hierarchy)"
    target = hierarchy / f"supervisor-bench-migration-{os.getpid()}"
    try:
        target.mkdir()
    except OSError as exc:
        return f"not measured ({exc.strerror} in {hierarchy})"
    try:
        moves = []
        for _ in range(SAMPLES):
            time.sleep(PAUSE_S)
            moves.append(_one_move(target))
    except (OSError, ValueError) as exc:
        return f"not measured ({exc})"
    finally:
        try:
            target.rmdir()
        except OSError:
            pass  # the last child is reaped: empty once the kernel has noticed; left otherwise
    favoured = "favordynmods" in mounts_text
    return (
        f"{statistics.median(moves) * 1000:.2f} ms after {PAUSE_S * 1000:.0f} ms of quiet "
        f"(median of {SAMPLES}, {hierarchy}); favordynmods {'mounted' if favoured else 'not mounted'}"
    )
