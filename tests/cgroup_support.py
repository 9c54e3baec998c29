"""What the cgroup tests need from the machine, and a probe that says which modes they can run
in here (.ci/run prints it: `python tests/cgroup_support.py`).

cgroup2: a private mount of the unified hierarchy at a temporary directory (root only), in
which each test makes its own root directory. cgroup1: the daemon's automatic choice on a
machine with the v1 freezer (and memory, pids) hierarchies mounted and writable.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sandbox_supervisor.daemon.runtime import cgroups

MOUNT = shutil.which("mount") or "/bin/mount"
UMOUNT = shutil.which("umount") or "/bin/umount"
MOUNT_TIMEOUT_S = 10
EMPTY_TIMEOUT_S = 5


def cgroup2_unavailable() -> str | None:
    """Why a private cgroup2 mount cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "mounting a private cgroup2 hierarchy needs root"
    if "cgroup2" not in Path("/proc/filesystems").read_text():
        return "the kernel has no cgroup2 file system"
    with tempfile.TemporaryDirectory() as directory:
        done = subprocess.run([MOUNT, "-t", "cgroup2", "none", directory], capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)
        if done.returncode != 0:
            return f"mount -t cgroup2 failed: {done.stderr.strip() or done.returncode}"
        subprocess.run([UMOUNT, directory], check=True, timeout=MOUNT_TIMEOUT_S)
    return None


def auto_mode(state_dir: str = "/nonexistent-probe", memory_max: int | None = 1 << 30, pids_max: int | None = 1024) -> cgroups.Plan:
    """The daemon's automatic choice here, without preparing anything."""
    return cgroups.gather_and_choose(cgroups.SETTING_AUTO, None, memory_max, pids_max)


def cgroup1_unavailable() -> str | None:
    plan = auto_mode()
    if plan.mode != cgroups.MODE_CGROUP1:
        return f"the automatic mode here is {plan.mode}, not cgroup1 (no writable v1 freezer hierarchy, or a delegated cgroup2)"
    return None


def v1_memory_unavailable() -> str | None:
    plan = auto_mode()
    if cgroups.V1_MEMORY not in plan.v1_parents:
        return "the v1 memory controller is not mounted and writable in the daemon's own cgroup"
    return None


def _clean(directory: Path) -> None:
    """Kill everything in the cgroups under `directory`, then remove them, deepest first."""
    for path in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [directory]:
        kill = path / "cgroup.kill"
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + EMPTY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


@contextmanager
def private_cgroup2() -> Iterator[Path]:
    """A fresh directory in a private mount of the cgroup2 hierarchy; removed and unmounted
    afterwards."""
    with tempfile.TemporaryDirectory() as mount_point:
        subprocess.run([MOUNT, "-t", "cgroup2", "none", mount_point], check=True, timeout=MOUNT_TIMEOUT_S)
        root = Path(mount_point) / f"sst-{uuid.uuid4().hex[:12]}"
        root.mkdir()
        try:
            yield root
        finally:
            _clean(root)
            subprocess.run([UMOUNT, mount_point], check=True, timeout=MOUNT_TIMEOUT_S)


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def base_directories() -> list[Path]:
    """The daemons' base directories (`sandbox-supervisor.*`) in this machine's automatic
    mode's hierarchies."""
    plan = auto_mode()
    parents = list(plan.v1_parents.values()) + ([plan.v2_root] if plan.v2_root else [])
    found: list[Path] = []
    for parent in parents:
        try:
            found += [p for p in Path(parent).iterdir() if p.name.startswith(cgroups.BASE_PREFIX) and p.is_dir()]
        except OSError:
            continue
    return found


def bases_named_under(root: Path) -> set[str]:
    """The base names (cgroups.base_name) of every directory under `root`, which holds the
    state directories of the daemons the suite started."""
    return {cgroups.base_name(directory) for directory, _dirs, _files in os.walk(root)}


def remove_empty(bases: set[Path]) -> None:
    """Remove the command cgroups without processes under each base, then the base (rmdir
    refuses any that still holds a process or a child)."""
    for base in bases:
        for child in [p for p in base.iterdir() if p.is_dir()] if base.is_dir() else []:
            try:
                child.rmdir()
            except OSError:
                continue
        try:
            base.rmdir()
        except OSError:
            continue


def main() -> int:
    v2 = cgroup2_unavailable()
    v1 = cgroup1_unavailable()
    memory = v1_memory_unavailable()
    print(f"cgroup tests: automatic mode on this machine: {auto_mode().mode}")
    print(f"cgroup tests: cgroup2 (private mount): {'runs' if v2 is None else 'skipped: ' + v2}")
    print(f"cgroup tests: cgroup1 (v1 freezer/memory/pids): {'runs' if v1 is None else 'skipped: ' + v1}")
    print(f"cgroup tests: OOM kill (v1 memory controller): {'runs' if memory is None else 'skipped: ' + memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
