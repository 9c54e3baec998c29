"""One cgroup per command (runtime/cgroups.py): the pure decisions, then real cgroups — a
private cgroup2 mount and the machine's v1 hierarchies — with real shells, a real journal and
a real daemon. Skips name the facility this machine lacks (tests/cgroup_support.py)."""

from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cgroup_support import (
    cgroup1_unavailable,
    cgroup2_unavailable,
    kill_quietly,
    auto_mode,
    private_cgroup2,
    remove_empty,
    v1_memory_unavailable,
)
from sandbox_supervisor.protocol.frames import EXEC_COMPLETED, ExecCompletedBody
from sandbox_supervisor.daemon.runtime import cgroups, ready_cgroups
from sandbox_supervisor.daemon.runtime.cgroups import (
    CgroupMounts,
    Plan,
    V2Facts,
    choose_plan,
    delegated_root,
    parse_keyed,
    parse_mountinfo,
    parse_proc_cgroup,
)
from sandbox_supervisor.daemon.runtime.command_host import POOL_UNDERSCORE_VARIABLE
from sandbox_supervisor.daemon.runtime.process_group import ProcessGroup
from sandbox_supervisor.daemon.runtime.process_host import ProcessHost
from sandbox_supervisor.daemon.runtime.processes import read_stat
from sandbox_supervisor.daemon.runtime.ready_cgroups import READY_PREFIX, READY_TARGET, ReadyCgroups
from sandbox_supervisor.daemon.runtime.recovery import kill_leftover_groups
from sandbox_supervisor.daemon.runtime.shell import ShellRuntime
from sandbox_supervisor.daemon.runtime.tool import RunningCall
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import RecordedProcess, StateStore
from sandbox_supervisor.testing.client import http_request
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.daemon import DaemonLayout, in_process_daemon, make_layout, running_daemon
from shell_support import rig_settings, shell_call

DEADLINE_S = 10
POLL_S = 0.02
MIB = 1024 * 1024
GRACE_S = 0.3
# A child that leaves the command's process group and session (setsid -f), records its pid,
# and would sleep for minutes; the command says "ready" once the pid file is there.
ESCAPES = (
    "setsid -f sh -c 'echo $$ > escaped.tmp; mv escaped.tmp escaped.pid; exec sleep 300'; "
    "while [ ! -s escaped.pid ]; do sleep 0.01; done; echo ready; sleep 60"
)

V2_SKIP = cgroup2_unavailable()
V1_SKIP = cgroup1_unavailable()
OOM_SKIP = v1_memory_unavailable()
needs_cgroup2 = pytest.mark.skipif(V2_SKIP is not None, reason=f"cgroup2: {V2_SKIP}")
needs_cgroup1 = pytest.mark.skipif(V1_SKIP is not None, reason=f"cgroup1: {V1_SKIP}")
needs_v1_memory = pytest.mark.skipif(OOM_SKIP is not None, reason=f"OOM: {OOM_SKIP}")


# --- pure decisions --------------------------------------------------------------------------

HYBRID_CGROUP = """12:pids:/
11:freezer:/
4:memory:/process_api/abc
3:cpu,cpuacct:/
1:name=systemd:/
0::/
"""
UNIFIED_CGROUP = "0::/system.slice/sandbox-supervisor.service\n"
MOUNTINFO = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime shared:9 - cgroup cgroup rw,pids
40 31 0:40 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:38 /sub /mnt/bind rw,relatime - cgroup2 cgroup2 rw
43 31 0:38 / /mnt/with\\040space rw,relatime - cgroup2 cgroup2 rw
"""


def test_proc_cgroup_names_the_unified_path_and_each_v1_controller():
    parsed = parse_proc_cgroup(HYBRID_CGROUP)
    assert parsed.unified == "/"
    assert parsed.v1 == {"pids": "/", "freezer": "/", "memory": "/process_api/abc", "cpu": "/", "cpuacct": "/"}
    assert parse_proc_cgroup(UNIFIED_CGROUP) == cgroups.ProcCgroup("/system.slice/sandbox-supervisor.service", {})
    assert parse_proc_cgroup("garbage\n") == cgroups.ProcCgroup(None, {})


def test_mountinfo_finds_hierarchy_roots_only_and_unescapes_paths():
    mounts = parse_mountinfo(MOUNTINFO)
    # A bind mount of a subtree (/sub) would put /proc/self/cgroup's paths in the wrong place.
    assert mounts == CgroupMounts(
        ("/sys/fs/cgroup/unified", "/mnt/with space"),
        {"memory": "/sys/fs/cgroup/memory", "freezer": "/sys/fs/cgroup/freezer", "pids": "/sys/fs/cgroup/pids"},
    )
    assert cgroups.hierarchy_path("/sys/fs/cgroup/memory", "/process_api/abc") == "/sys/fs/cgroup/memory/process_api/abc"
    assert cgroups.hierarchy_path("/sys/fs/cgroup/pids", "/") == "/sys/fs/cgroup/pids"


def test_a_cgroup_file_is_read_whole_past_one_read(tmp_path):
    """cgroup.procs of a command with many processes is longer than one read: all of it is
    read, and as text; a missing file is FileNotFoundError, as callers expect."""
    procs = tmp_path / "cgroup.procs"
    pids = [str(pid) for pid in range(100_000, 130_000)]  # about 210 KB, several reads
    procs.write_text("\n".join(pids) + "\n")
    assert cgroups._read(str(procs)).split() == pids
    assert cgroups._pids_in(str(tmp_path)) == [int(pid) for pid in pids]
    with pytest.raises(FileNotFoundError):
        cgroups._read(str(tmp_path / "cgroup.events"))


def test_keyed_files_memory_events_and_oom_control():
    assert parse_keyed("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")["oom_kill"] == 2
    assert parse_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n") == {"oom_kill_disable": 0, "under_oom": 0, "oom_kill": 1}
    assert parse_keyed("populated 1\nfrozen 0\n")["populated"] == 1
    assert parse_keyed("weird line here\nx notanumber\n") == {}
    assert cgroups.parse_procs("12\n345\n\n") == [12, 345]


def test_base_name_is_stable_per_state_directory():
    assert cgroups.base_name("/var/lib/s") == cgroups.base_name("/var/lib/s/")
    assert cgroups.base_name("/var/lib/s") != cgroups.base_name("/var/lib/t")
    assert cgroups.base_name("/var/lib/s").startswith(cgroups.BASE_PREFIX)


V1_ALL = {"freezer": "/fz/own", "memory": "/mem/own", "pids": "/pids/own"}


def usable(path: str = "/cg/root", **kw: Any) -> V2Facts:
    return V2Facts(path, usable=True, delegated=True, **kw)


def test_off_means_process_groups_whatever_the_machine_offers():
    assert choose_plan("off", None, usable(), V1_ALL, MIB * 64, 100) == Plan("process-group")


def test_an_explicit_root_that_cannot_be_used_is_a_problem_not_a_fallback():
    plan = choose_plan("auto", "/cg/x", V2Facts("/cg/x", usable=False, delegated=True), V1_ALL, None, None)
    assert plan.mode == "process-group" and plan.problem is not None and "/cg/x" in plan.problem


def test_a_daemon_inside_its_root_moves_into_a_leaf_and_limits_use_v2_controllers():
    facts = usable(controllers=frozenset({"memory", "pids", "cpu"}), daemon_inside=True)
    plan = choose_plan("auto", None, facts, V1_ALL, MIB * 64, 100)
    assert plan.mode == "cgroup2" and plan.v2_root == "/cg/root"
    assert plan.move_daemon_to == "/cg/root/supervisor"
    assert plan.v2_limits == {"memory", "pids"} and plan.v1_parents == {}
    assert (plan.memory_max, plan.pids_max) == (MIB * 64, 100)


def test_cgroup2_without_limit_controllers_takes_limits_from_v1_where_mounted():
    plan = choose_plan("auto", "/cg/root", usable(controllers=frozenset({"hugetlb"})), {"memory": "/mem/own"}, MIB * 64, 100)
    assert plan.mode == "cgroup2" and plan.v2_limits == frozenset()
    assert plan.v1_parents == {"memory": "/mem/own"}
    # pids: neither v2 nor v1 offers it, so it is not enforced (and reported so).
    assert (plan.memory_max, plan.pids_max) == (MIB * 64, None)


def test_auto_never_manages_an_undelegated_or_the_hierarchy_root_cgroup():
    undelegated = V2Facts("/cg/own", usable=True, delegated=False)
    root = V2Facts("/cg", usable=True, delegated=True, is_hierarchy_root=True)
    for facts in (undelegated, root, None):
        plan = choose_plan("auto", None, facts, V1_ALL, None, None)
        assert plan.mode == "cgroup1" and plan.v1_parents == {"freezer": "/fz/own"}
        assert choose_plan("auto", None, facts, {}, None, None).mode == "process-group"


def test_cgroup1_needs_the_freezer_and_uses_memory_and_pids_only_for_limits_set():
    plan = choose_plan("auto", None, None, V1_ALL, MIB * 64, None)
    assert plan.mode == "cgroup1" and plan.v1_parents == {"freezer": "/fz/own", "memory": "/mem/own"}
    assert (plan.memory_max, plan.pids_max) == (MIB * 64, None)
    assert choose_plan("auto", None, None, {"memory": "/mem/own", "pids": "/p"}, MIB * 64, 5).mode == "process-group"


def test_delegation_is_the_own_cgroup_or_the_parent_of_the_daemons_leaf():
    own = "/sys/fs/cgroup/system.slice/s.service"
    assert delegated_root(own, True, False) == (own, True)
    assert delegated_root(own + "/supervisor", False, True) == (own, False)
    assert delegated_root(own + "/other", False, True) is None
    assert delegated_root(own, False, False) is None


def test_an_automatic_choice_that_cannot_be_prepared_falls_back_and_says_why(tmp_path, monkeypatch):
    def refuse(self: cgroups.Cgroups) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cgroups, "gather_and_choose", lambda *args: Plan("cgroup1", v1_parents={"freezer": "/x"}))
    monkeypatch.setattr(cgroups.Cgroups, "prepare", refuse)
    groups = cgroups.detect("auto", None, tmp_path)
    assert groups.mode == "process-group" and not groups.enabled
    assert groups.describe()["fallback"] == "cgroup1 could not be prepared: Permission denied"
    # An explicit root is never a silent fallback.
    monkeypatch.setattr(cgroups, "gather_and_choose", lambda *args: Plan("cgroup2", v2_root="/x"))
    with pytest.raises(ValueError, match="Permission denied"):
        cgroups.detect("auto", "/x", tmp_path)


def test_cgroups_module_imports_only_the_standard_library():
    code = (
        "import sys, json\n"
        "import sandbox_supervisor.daemon.runtime.cgroups\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout)
    heavy = [m for m in loaded if m.split(".")[0] in ("pydantic", "pydantic_core", "trio", "structlog")]
    assert heavy == []
    ours = [m for m in loaded if m.startswith("sandbox_supervisor") and m not in (
        "sandbox_supervisor", "sandbox_supervisor.daemon", "sandbox_supervisor.daemon.runtime",
        "sandbox_supervisor.daemon.runtime.cgroups",
    )]
    assert ours == []


# --- a shell runtime with cgroups --------------------------------------------------------------


@dataclass
class Rig:
    shell: ShellRuntime
    store: StateStore
    workspace: Path

    def running_call(self, command: str, **params: Any) -> RunningCall:
        return shell_call(self.workspace, command, **params)

    async def run(self, command: str, **params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tool result and the exec.completed body."""
        running = self.running_call(command, **params)
        result = await self.shell.execute(running)
        completed = [body for kind, body in running.final_events if kind == EXEC_COMPLETED]
        assert len(completed) == 1
        return result, completed[0]

    async def escaped_pid(self) -> int:
        path = self.workspace / "escaped.pid"
        with trio.fail_after(DEADLINE_S):
            while not path.exists():
                await trio.sleep(POLL_S)
        return int(path.read_text())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    with StateStore.open(tmp_path / "state") as opened:
        yield opened


@asynccontextmanager
async def runtime(store: StateStore, tmp_path: Path, groups: cgroups.Cgroups | None) -> AsyncIterator[Rig]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    settings = rig_settings(store.path.parent, kill_grace_s=GRACE_S, cgroups=groups)
    async with trio.open_nursery() as nursery:
        shell = ShellRuntime(settings, store, Journal(store), nursery)
        try:
            yield Rig(shell, store, workspace)
        finally:
            await shell.stop_all()
            with trio.fail_after(DEADLINE_S):
                while shell.commands:
                    await trio.sleep(POLL_S)
            await shell.host.aclose()


def alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


async def wait_dead(pid: int) -> None:
    with trio.fail_after(DEADLINE_S):
        while alive(pid):
            await trio.sleep(POLL_S)


MODES = [
    pytest.param("cgroup2", marks=needs_cgroup2, id="cgroup2"),
    pytest.param("cgroup1", marks=needs_cgroup1, id="cgroup1"),
]


@pytest.fixture
def mode_cgroups(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[cgroups.Cgroups]:
    """Cgroups in the mode the test is parametrised with (memory_max/pids_max from marks)."""
    limits = request.node.get_closest_marker("limits")
    kwargs = limits.kwargs if limits else {}
    state_dir = tmp_path / "state"
    if request.param == "cgroup2":
        with private_cgroup2() as root:
            groups = cgroups.detect("auto", str(root), state_dir, **kwargs)
            assert groups.mode == "cgroup2"
            try:
                yield groups
            finally:
                groups.close()
    else:
        groups = cgroups.detect("auto", None, state_dir, **kwargs)
        assert groups.mode == "cgroup1"
        try:
            yield groups
        finally:
            groups.kill_leftovers()
            groups.close()


def command_cgroups(groups: cgroups.Cgroups) -> list[cgroups.CommandCgroup]:
    """The cgroups under the daemon's bases, less those made ahead (runtime/ready_cgroups.py)."""
    return [cgroup for cgroup in groups.existing() if not cgroup.name.startswith(READY_PREFIX)]


def parametrize_modes(func: Any) -> Any:
    return pytest.mark.parametrize("mode_cgroups", MODES, indirect=True)(func)


async def test_process_group_mode_a_setsid_child_still_escapes_a_timeout(store, tmp_path):
    """The fallback behaves as before: the group ends, a child that left it (setsid) does not."""
    async with runtime(store, tmp_path, None) as rig:
        result, completed = await rig.run(ESCAPES, timeout_ms=1000)
        escaped = await rig.escaped_pid()
        try:
            assert result["timed_out"] is True and "oom_killed" not in completed
            assert alive(escaped)
        finally:
            kill_quietly(escaped)


@parametrize_modes
async def test_a_setsid_child_dies_on_timeout(store, tmp_path, mode_cgroups):
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        result, _ = await rig.run(ESCAPES, timeout_ms=1000)
        escaped = await rig.escaped_pid()
        try:
            assert result["timed_out"] is True and result["signal"] == "SIGTERM"
            assert result["stdout"]["head"] == "ready\n"
            await wait_dead(escaped)
        finally:
            kill_quietly(escaped)
        # Forgotten once empty, and its cgroup removed (by a worker thread, soon after).
        with trio.fail_after(DEADLINE_S):
            while rig.shell.commands or command_cgroups(mode_cgroups):
                await trio.sleep(POLL_S)


@parametrize_modes
async def test_a_setsid_child_ignoring_sigterm_dies_on_stop(store, tmp_path, mode_cgroups):
    command = ESCAPES.replace("sh -c '", "sh -c 'trap \"\" TERM; ")
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        async with trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}

            async def run() -> None:
                outcome["result"], _ = await rig.run(command, timeout_ms=60_000)

            nursery.start_soon(run)
            escaped = await rig.escaped_pid()
            try:
                assert alive(escaped)
                with trio.fail_after(DEADLINE_S):
                    await rig.shell.stop_all()
                await wait_dead(escaped)
            finally:
                kill_quietly(escaped)
        assert outcome["result"]["signal"] == "SIGTERM"


@parametrize_modes
async def test_the_command_is_in_its_cgroup_before_its_first_instruction(store, tmp_path, mode_cgroups):
    """The wrapper waits on its gate until the daemon placed it: the command's very first
    child already sees the cgroup named by its call_id."""
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        running = rig.running_call("cat /proc/self/cgroup")
        result = await rig.shell.execute(running)
    lines = result["stdout"]["head"].splitlines()
    hierarchy = "0::" if mode_cgroups.mode == "cgroup2" else "freezer:"
    placed = [line for line in lines if hierarchy in line]
    assert placed and placed[0].endswith("/" + running.call.call_id), lines


async def test_a_command_that_cannot_be_placed_never_runs(tmp_path):
    from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost
    from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec
    from sandbox_supervisor.daemon.runtime.process_group import ProcessGroup

    nowhere = cgroups.CommandCgroup("x", str(tmp_path / "no-such-cgroup"), {})
    spec = HolderSpec(
        argv=("/bin/sh", "-c", "touch ran"), cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"}, stdin="null",
        cgroup=nowhere.membership,
    )
    async with trio.open_nursery() as nursery:
        host = CommandHost()
        with pytest.raises(OSError) as raised:
            await ProcessGroup.hosted(host, "x", tmp_path / "spool", spec, nowhere)
        await host.aclose()
    assert raised.value.stage == "cgroup"  # type: ignore[attr-defined]
    assert not (tmp_path / "ran").exists()


@parametrize_modes
async def test_background_output_after_exit_still_arrives_and_the_cgroup_lingers_until_empty(store, tmp_path, mode_cgroups):
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        running = rig.running_call("(sleep 0.5; echo late) & echo early")
        result = await rig.shell.execute(running)
        assert result["stdout"]["head"] == "early\n"
        call_id = running.call.call_id
        assert call_id in rig.shell.commands  # lingering: its cgroup still has the sleeper
        with trio.fail_after(DEADLINE_S):
            while call_id in rig.shell.commands:
                await trio.sleep(POLL_S)
        spooled = (store.path.parent / "spool" / call_id / "stdout").read_bytes()
        assert spooled == b"early\nlate\n"
        with trio.fail_after(DEADLINE_S):  # removed by a worker thread once forgotten
            while command_cgroups(mode_cgroups):
                await trio.sleep(POLL_S)


@parametrize_modes
@pytest.mark.limits(pids_max=4)
async def test_pids_max_limits_the_commands_processes(store, tmp_path, mode_cgroups):
    if mode_cgroups.pids_max is None:
        pytest.skip(f"{mode_cgroups.mode}: no pids controller here (v2 nor v1)")
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        result, _ = await rig.run("for i in 1 2 3 4 5 6 7 8; do sleep 2 & done; wait; echo done", timeout_ms=20_000)
    assert "fork" in result["stderr"]["head"].lower() or "resource" in result["stderr"]["head"].lower()


@pytest.mark.parametrize(
    "mode_cgroups",
    [
        pytest.param("cgroup2", marks=[needs_cgroup2, needs_v1_memory], id="cgroup2+v1-memory"),
        pytest.param("cgroup1", marks=[needs_cgroup1, needs_v1_memory], id="cgroup1"),
    ],
    indirect=True,
)
@pytest.mark.limits(memory_max=32 * MIB)
async def test_a_memory_limit_oom_kills_and_exec_completed_says_so(store, tmp_path, mode_cgroups):
    assert mode_cgroups.memory_max == 32 * MIB
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        grow = f"{sys.executable} -c \"x = b'a' * (512 * 1024 * 1024)\""
        result, completed = await rig.run(f"exec {grow}", timeout_ms=30_000)
        assert result["signal"] == "SIGKILL" and result["timed_out"] is False
        assert completed["oom_killed"] is True
        # The tool result keeps the seed's schema: no new field there.
        assert "oom_killed" not in result
        ExecCompletedBody.model_validate(completed)
        _, small = await rig.run("echo fits", timeout_ms=10_000)
        assert "oom_killed" not in small and small["exit_code"] == 0


@parametrize_modes
def test_a_kill_of_a_cgroup_that_goes_meanwhile_is_no_error(mode_cgroups, monkeypatch):
    """An empty cgroup is anyone's to remove: one removed while it is killed (in v1 between
    its freeze and the wait for it, in v2 before the `cgroup.kill` write) had nothing left to
    kill, and the kill returns instead of raising, which would cut a stop short."""
    cgroup = mode_cgroups.create("e7a1c3d5-0f2b-4c6d-8e9f-a1b2c3d4e5f6")
    write, read = cgroups._write, cgroups._read

    def write_after_removal(path: str, text: str) -> None:
        if os.path.basename(path) == "cgroup.kill":
            assert cgroup.remove()
        write(path, text)

    def read_after_removal(path: str) -> str:
        if os.path.basename(path) == "freezer.state":
            assert cgroup.remove()  # frozen, and empty
        return read(path)

    monkeypatch.setattr(cgroups, "_write", write_after_removal)
    monkeypatch.setattr(cgroups, "_read", read_after_removal)
    cgroup.kill()
    assert not os.path.isdir(cgroup.membership)


@parametrize_modes
async def test_a_restart_kills_and_removes_the_command_cgroups_a_crash_left(store, tmp_path, mode_cgroups):
    leftover = mode_cgroups.create("a-crashed-call")
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        leftover.add(sleeper.pid)
        again = cgroups.detect("auto", mode_cgroups.plan.v2_root, tmp_path / "state")
        assert again.mode == mode_cgroups.mode
        assert kill_leftover_groups(store, store.path.parent, again) == 1
        assert sleeper.wait(timeout=DEADLINE_S) == -9
        assert again.existing() == []
    finally:
        kill_quietly(sleeper.pid)
        sleeper.wait()


@needs_cgroup2
def test_a_daemon_inside_its_cgroup_root_moves_into_a_leaf(tmp_path):
    with private_cgroup2() as root:
        code = (
            "import os, sys\n"
            "from sandbox_supervisor.daemon.runtime import cgroups\n"
            "open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
            "groups = cgroups.detect('auto', sys.argv[1], sys.argv[2], pids_max=10)\n"
            "print(groups.mode, open('/proc/self/cgroup').read().splitlines()[-1])\n"
        )
        done = subprocess.run([sys.executable, "-c", code, str(root), str(tmp_path / "state")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        mode, own = done.stdout.split()
        assert mode == "cgroup2"
        assert own.startswith("0::") and own.endswith(f"/{root.name}/supervisor")
        assert (root / cgroups.base_name(tmp_path / "state")).is_dir()


# --- the daemon ---------------------------------------------------------------------------------



@contextmanager
def layout_in_mode(
    tmp_path: Path, authority: LoopbackAuthority, mode: str, exec_settings: dict[str, Any] | None = None
) -> Iterator[DaemonLayout]:
    """A daemon layout whose commands get cgroups in `mode`: a private cgroup2 mount (held
    until the block ends) as `exec.cgroup_root`, or the machine's own hierarchy."""
    with private_cgroup2() if mode == "cgroup2" else nullcontext() as root:
        settings = dict(exec_settings or {})
        if root is not None:
            settings["cgroup_root"] = str(root)
        yield make_layout(tmp_path / "d", authority=authority, exec=settings)

@pytest.mark.parametrize("mode", MODES)
async def test_the_daemon_reports_its_mode_and_a_stop_ends_escaped_children(tmp_path, authority, log_lines, mode):
    with layout_in_mode(tmp_path, authority, mode, {"kill_grace_ms": 300, "pids_max": 64}) as layout:
        async with in_process_daemon(layout) as daemon:
            health = json.loads((await http_request(daemon.tcp, "GET", "/healthz")).body)
            assert health["isolation"]["mode"] == mode
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                await session.call("execute_shell_command", {"command": ESCAPES, "timeout_ms": 60_000}, idempotency_key="k1")
                pid_file = layout.workspace / "escaped.pid"
                with trio.fail_after(DEADLINE_S):
                    while not pid_file.exists():
                        await trio.sleep(POLL_S)
                escaped = int(pid_file.read_text())
        try:
            await wait_dead(escaped)  # the daemon's stop (drain) ended it
        finally:
            kill_quietly(escaped)
    started = [line for line in log_lines() if line["event"] == "supervisor.isolation"]
    assert len(started) == 1 and started[0]["mode"] == mode
    assert started[0]["pids_max"] == health["isolation"]["pidsMax"]


def membership_path(cgroup_text: str, mode: str) -> str:
    """The path of the hierarchy a mode keeps membership in, from a /proc/PID/cgroup."""
    parsed = cgroups.parse_proc_cgroup(cgroup_text)
    path = parsed.unified if mode == "cgroup2" else parsed.v1.get(cgroups.V1_FREEZER)
    assert path is not None, cgroup_text
    return path


def membership_of(pid: int, mode: str) -> str:
    """The membership path of a running process, from its /proc/PID/cgroup."""
    return membership_path(Path(f"/proc/{pid}/cgroup").read_text(), mode)


async def idle_shell_placed_ahead(base: str, mode: str) -> tuple[int, str]:
    """The pid and /proc/PID/cgroup of this test's command host's idle shell, once it waits
    in a cgroup made ahead below `base` (the daemon's base name)."""
    with trio.fail_after(DEADLINE_S):
        while True:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                    stat = read_stat(int(entry.name))
                    text = (entry / "cgroup").read_text()
                except (OSError, ValueError):
                    continue
                if stat is None or POOL_UNDERSCORE_VARIABLE.encode() not in cmdline:
                    continue
                host = read_stat(stat.ppid)
                if host is None or host.ppid != os.getpid():  # the in-process daemon's host
                    continue
                path = membership_path(text, mode)
                if f"/{base}/{READY_PREFIX}" in path:
                    return int(entry.name), text
            await trio.sleep(POLL_S)


@pytest.mark.parametrize("mode", MODES)
async def test_a_pooled_call_runs_in_the_cgroup_its_shell_waited_in(tmp_path, authority, mode):
    """runtime/ready_cgroups.py end to end: once a spawn request offered a cgroup made ahead,
    the host's next idle shell waits in it, and the next call runs in that shell there: no
    cgroup is made or moved into on the call's path."""
    with layout_in_mode(tmp_path, authority, mode) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                # The first call starts the making; the second takes one made ahead and
                # offers the next to the host, whose refilled shell then waits in it.
                for key in ("k1", "k2"):
                    warm = await session.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key=key)
                    assert warm["ok"], warm
                pid, waited_in = await idle_shell_placed_ahead(cgroups.base_name(layout.state_dir), mode)
                answer = await session.call_and_wait(
                    "execute_shell_command", {"command": "echo $$; cat /proc/self/cgroup"}, idempotency_key="k3"
                )
    assert answer["ok"], answer
    shell_pid, *lines = answer["result"]["stdout"]["head"].splitlines()
    assert int(shell_pid) == pid
    assert "\n".join(lines) == waited_in.strip()


@needs_cgroup2
async def test_a_configured_cgroup_root_that_is_not_one_stops_the_start(tmp_path, authority):
    from sandbox_supervisor.daemon.app import StartupError

    not_a_cgroup = tmp_path / "plain"
    not_a_cgroup.mkdir()
    layout = make_layout(tmp_path / "d", authority=authority, exec={"cgroup_root": str(not_a_cgroup)})
    with pytest.raises(StartupError, match="cgroup_root"):
        async with in_process_daemon(layout):
            pass


async def test_cgroup_off_reports_process_groups(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"cgroup": "off"})
    async with in_process_daemon(layout) as daemon:
        health = json.loads((await http_request(daemon.tcp, "GET", "/healthz")).body)
    assert health["isolation"] == {"mode": "process-group", "memoryMax": None, "pidsMax": None}



# --- cgroups removed from outside while the daemon runs ----------------------------------------


def daemon_bases(mode: str, layout: DaemonLayout) -> list[Path]:
    """The daemon's base directories (runtime/cgroups.py base_name), in each hierarchy."""
    name = cgroups.base_name(layout.state_dir)
    if mode == "cgroup2":
        root = layout.settings["exec"]["cgroup_root"]  # the private mount (layout_in_mode)
        return [Path(root) / name]
    return [Path(parent) / name for parent in auto_mode().v1_parents.values() if (Path(parent) / name).is_dir()]


@parametrize_modes
async def test_a_restart_keeps_a_running_commands_cgroup_made_ahead_by_its_recorded_name(store, tmp_path, mode_cgroups):
    """A command still running under its command host is kept by the name its process record
    gives its cgroup (a `ready-*` one is not named after the call); a `ready-*` cgroup the
    previous host left an idle shell in is a leftover like any other."""
    kept = mode_cgroups.create(READY_PREFIX + "kept")
    left = mode_cgroups.create(READY_PREFIX + "left")
    running = subprocess.Popen(["sleep", "300"], start_new_session=True)
    idle = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        kept.add(running.pid)
        left.add(idle.pid)
        call_id = "5ac17de4-a7f9-4f53-8caa-8d5f9e8dd376"
        keep = {call_id: RecordedProcess(call_id, running.pid, running.pid, 0, kept.name)}
        again = cgroups.detect("auto", mode_cgroups.plan.v2_root, tmp_path / "state")
        assert kill_leftover_groups(store, store.path.parent, again, keep=keep) == 1
        assert idle.wait(timeout=DEADLINE_S) == -9
        assert running.poll() is None
        assert [cgroup.name for cgroup in again.existing()] == [kept.name]
    finally:
        for process in (running, idle):
            kill_quietly(process.pid)
            process.wait()


@parametrize_modes
async def test_cgroups_made_ahead_go_to_pooled_calls_when_offered_and_are_skipped_once_removed(mode_cgroups):
    async with trio.open_nursery() as nursery:
        ready = ReadyCgroups(mode_cgroups, nursery)
        assert ready.take(pooled=True) is None  # none yet: the call makes its own, the making starts
        with trio.fail_after(DEADLINE_S):
            while ready.ready < READY_TARGET:
                await trio.sleep(POLL_S)
        made = [cgroup.name for cgroup in mode_cgroups.existing()]
        assert len(made) == READY_TARGET and all(name.startswith(READY_PREFIX) for name in made)
        offered = ready.offer(1)
        assert len(offered) == 1 and ready.offer(1) == []  # as many on offer as the host has shells
        plain = ready.take(pooled=False)
        assert plain is not None and plain != offered[0]  # a command no idle shell runs: never one on offer
        assert ready.take(pooled=True) == offered[0]
        for cgroup in [c for c in mode_cgroups.existing() if c not in (plain, offered[0])]:
            assert cgroup.remove()  # root's clean-up of empty cgroups, from outside
        assert ready.take(pooled=False) is None  # the removed ones are not handed out


def record_removals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every CommandCgroup.remove from now on, as (cgroup name, made on the event loop's
    thread), the removal itself done as before."""
    removals: list[tuple[str, bool]] = []
    remove = cgroups.CommandCgroup.remove

    def recording(self: cgroups.CommandCgroup) -> bool:
        removals.append((self.name, threading.current_thread() is threading.main_thread()))
        return remove(self)

    monkeypatch.setattr(cgroups.CommandCgroup, "remove", recording)
    return removals


@parametrize_modes
async def test_a_finished_commands_cgroup_is_removed_off_the_event_loop(store, tmp_path, mode_cgroups, monkeypatch):
    """An rmdir of a cgroup can wait milliseconds for the kernel to take the group offline:
    `_forget` hands it to a worker thread (ReadyCgroups.retire), never the event loop's."""
    removals = record_removals(monkeypatch)
    async with runtime(store, tmp_path, mode_cgroups) as rig:
        for _ in range(2):  # the first makes its own cgroup, the second takes one made ahead
            result, _ = await rig.run("true")
            assert result["exit_code"] == 0
        with trio.fail_after(DEADLINE_S):
            # Removed, not just attempted.
            while (
                rig.shell.commands
                or len(removals) < 2
                or {name for name, _ in removals} & {c.name for c in mode_cgroups.existing()}
            ):
                await trio.sleep(POLL_S)
        assert len(removals) == 2 and not any(on_loop for _, on_loop in removals), removals
        assert any(name.startswith(READY_PREFIX) for name, _ in removals)


@parametrize_modes
async def test_a_retired_cgroup_still_busy_is_logged_and_left(mode_cgroups, log_lines):
    busy = mode_cgroups.create("11111111-1111-4111-8111-111111111111")
    empty = mode_cgroups.create("22222222-2222-4222-8222-222222222222")
    member = subprocess.Popen(["sleep", "60"])
    try:
        Path(busy.membership, "cgroup.procs").write_text(str(member.pid))
        async with trio.open_nursery() as nursery:
            ready = ReadyCgroups(mode_cgroups, nursery)
            ready.retire(busy.name, busy)
            ready.retire(empty.name, empty)
        # The nursery waited for the removal: the empty one is gone, the busy one stays.
        assert not os.path.isdir(empty.membership) and os.path.isdir(busy.membership)
        failed = [line for line in log_lines() if line["event"] == "process.cgroup_remove_failed"]
        assert [line["call_id"] for line in failed] == [busy.name]
    finally:
        member.kill()
        member.wait()
    with trio.fail_after(DEADLINE_S):
        while busy.pids():
            await trio.sleep(POLL_S)
    assert busy.remove()


@parametrize_modes
async def test_retired_cgroups_go_in_one_hop_a_burst_or_with_a_refill(mode_cgroups, monkeypatch):
    """Waking a worker costs the loop about what an rmdir does: the cgroups of commands that
    finish close together are removed in one hop, and a refill's hop takes those queued."""
    batches: list[tuple[bool, list[str]]] = []  # (removed in a refill's hop, their names)
    remove_all = ready_cgroups.remove_all

    def recording(retired: list[tuple[str, cgroups.CommandCgroup]]) -> list[str]:
        batches.append((sys._getframe(1).f_code.co_name == "_make_after", [name for name, _ in retired]))
        return remove_all(retired)

    monkeypatch.setattr(ready_cgroups, "remove_all", recording)
    burst = [mode_cgroups.create(f"3333333{i}-3333-4333-8333-333333333333") for i in range(3)]
    async with trio.open_nursery() as nursery:
        ready = ReadyCgroups(mode_cgroups, nursery)
        ready.retire(burst[0].name, burst[0])
        await trio.testing.wait_all_tasks_blocked()  # the next command comes a moment later
        for cgroup in burst[1:]:
            ready.retire(cgroup.name, cgroup)
    assert batches == [(False, [cgroup.name for cgroup in burst])]
    assert not any(os.path.isdir(cgroup.membership) for cgroup in burst)

    batches.clear()
    late = mode_cgroups.create("44444444-4444-4444-8444-444444444444")
    async with trio.open_nursery() as nursery:
        ready = ReadyCgroups(mode_cgroups, nursery)
        ready.retire(late.name, late)
        assert ready.take(pooled=False) is None  # none ready: the refill starts, with the retired one
    assert batches == [(True, [late.name])]  # the refill's hop, and no other
    assert not os.path.isdir(late.membership) and ready.ready == READY_TARGET


@parametrize_modes
async def test_a_refusal_to_make_cgroups_ahead_is_retried_only_after_a_pause(mode_cgroups, monkeypatch, log_lines):
    attempts: list[str] = []

    def refuse(name: str) -> cgroups.CommandCgroup:
        attempts.append(name)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mode_cgroups, "create", refuse)
    async with trio.open_nursery() as nursery:
        ready = ReadyCgroups(mode_cgroups, nursery)
        assert ready.take(pooled=False) is None
        with trio.fail_after(DEADLINE_S):
            while not attempts or ready._refilling:
                await trio.sleep(POLL_S)
        for _ in range(10):
            assert ready.take(pooled=False) is None
            assert not ready._refilling  # no new attempt (a thread and a log line) per command
    assert len(attempts) == 1
    refused = [line for line in log_lines() if line["event"] == "cgroup.ready_refused"]
    assert len(refused) == 1 and refused[0]["made"] == 0


async def wait_childless(bases: list[Path]) -> None:
    """Until the last command's cgroup is gone (removed once its command ended), and the
    cgroups made ahead are all there (runtime/ready_cgroups.py: made by a worker thread)."""
    with trio.fail_after(DEADLINE_S):
        while True:
            children = [child.name for base in bases for child in base.iterdir() if child.is_dir()]
            made_ahead = [name for name in children if name.startswith(READY_PREFIX)]
            if len(made_ahead) == READY_TARGET * len(bases) and len(children) == len(made_ahead):
                return
            await trio.sleep(POLL_S)


@pytest.mark.parametrize("mode", MODES)
async def test_a_base_removed_from_outside_between_commands_is_made_again(tmp_path, authority, log_lines, mode):
    """Between commands the daemon's base directory is empty, and root's clean-up of empty
    `sandbox-supervisor.*` directories (tests/conftest.py's, before it was limited to the
    suite's own) took it: every later spawn failed `internal` `No such file or directory`."""
    with layout_in_mode(tmp_path, authority, mode, {"pids_max": 64}) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                first = await session.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="k1")
                assert first["ok"], first
                bases = daemon_bases(mode, layout)
                assert bases
                await wait_childless(bases)
                remove_empty(set(bases))  # the outside clean-up
                assert not any(base.is_dir() for base in bases)
                second = await session.call_and_wait(
                    "execute_shell_command", {"command": "cat /proc/self/cgroup; cat /proc/self/cgroup >&2"},
                    idempotency_key="k2",
                )
    assert second["ok"], second
    assert second["result"]["exit_code"] == 0
    name = cgroups.base_name(layout.state_dir)
    assert name in json.dumps(second["result"]["stdout"]), second  # in its cgroup, below the base made again
    events = [line["event"] for line in log_lines()]
    assert "shell.cgroup_base_restored" in events
    assert "shell.spawn_failed" not in events


@pytest.mark.parametrize("mode", MODES)
async def test_a_command_cgroup_removed_before_the_join_is_made_again(tmp_path, authority, log_lines, monkeypatch, mode):
    """The same clean-up between the command cgroup's making and the host's join (forced
    here by running it right before the spawn request, once the cgroups made ahead are
    there: the second command's is one of them): the host's child fails at its `cgroup`
    stage, before exec, so the command is spawned again in a fresh cgroup, once."""
    original = ProcessGroup.hosted.__func__  # type: ignore[attr-defined]
    removed: list[str] = []
    armed = [False]

    async def hosted(cls, host, call_id, directory, spec, cgroup=None, place=()):  # type: ignore[no-untyped-def]
        if armed[0] and not removed and cgroup is not None:
            removed.append(cgroup.name)
            remove_empty({Path(d).parent for d in cgroup.directories()})  # its cgroup, then the base
            assert not Path(cgroup.membership).exists()
        return await original(cls, host, call_id, directory, spec, cgroup, place)

    monkeypatch.setattr(ProcessGroup, "hosted", classmethod(hosted))
    with layout_in_mode(tmp_path, authority, mode) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                first = await session.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="k0")
                assert first["ok"], first
                await wait_childless(daemon_bases(mode, layout))
                armed[0] = True
                answer = await session.call_and_wait(
                    "execute_shell_command", {"command": "cat /proc/self/cgroup"}, idempotency_key="k1"
                )
    assert removed, "the clean-up never ran"
    assert removed[0].startswith(READY_PREFIX), removed  # the cgroup made ahead was the one removed
    assert answer["ok"], answer
    assert answer["result"]["exit_code"] == 0
    assert cgroups.base_name(layout.state_dir) in json.dumps(answer["result"]["stdout"]), answer
    events = [line["event"] for line in log_lines()]
    assert events.count("shell.cgroup_removed") == 1
    assert "shell.cgroup_base_restored" in events
    assert "shell.spawn_failed" not in events


@pytest.mark.parametrize("mode", MODES)
async def test_a_cgroup_removed_on_every_attempt_frees_the_key(tmp_path, authority, log_lines, monkeypatch, mode):
    """When the clean-up wins both attempts the call fails `internal`, but nothing ran and
    the failure says nothing about the call: the key is freed, so the same call sent again
    with the same key runs (a new execution, not a replay of the failure)."""
    original = ProcessGroup.hosted.__func__  # type: ignore[attr-defined]
    removing = [True]

    async def hosted(cls, host, call_id, directory, spec, cgroup=None, place=()):  # type: ignore[no-untyped-def]
        if removing[0] and cgroup is not None:
            remove_empty({Path(d).parent for d in cgroup.directories()})
        return await original(cls, host, call_id, directory, spec, cgroup, place)

    monkeypatch.setattr(ProcessGroup, "hosted", classmethod(hosted))
    with layout_in_mode(tmp_path, authority, mode) as layout:
        marker = layout.workspace / "ran"
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                params = {"command": "echo x >> ran"}
                failed = await session.call_and_wait("execute_shell_command", params, idempotency_key="k1")
                assert not marker.exists()
                removing[0] = False
                again = await session.call_and_wait("execute_shell_command", params, idempotency_key="k1")
    assert not failed["ok"] and failed["error"]["code"] == "internal", failed
    assert again["ok"], again
    assert again["call_id"] != failed["call_id"]  # run anew, not the failure replayed
    assert marker.read_text() == "x\n"
    spawn_failed = [line for line in log_lines() if line["event"] == "shell.spawn_failed"]
    assert [(line["stage"], line["errno"]) for line in spawn_failed] in ([("cgroup", "ENOENT")], [("cgroup", "ENODEV")])


# --- held processes (start_process, docs/protocol.md §7.7) -------------------------------------


async def _held_ran(session, command: str, key: str, call_id: str | None = None) -> str:
    """Start `command` as a held process and wait for its exec.completed, exit status 0; its
    call_id."""
    call_id = await session.call("start_process", {"command": command}, idempotency_key=key, call_id=call_id)
    assert (await session.result(call_id))["ok"]
    assert (await _held_completed(session, call_id))["exit_code"] == 0
    return call_id


async def _held_completed(session, call_id: str) -> dict[str, Any]:
    frame = await session.receive_until(
        lambda f: f["kind"] == EXEC_COMPLETED and f["body"]["call_id"] == call_id, timeout=DEADLINE_S
    )
    return frame["body"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_held_process_is_in_its_own_cgroup_and_its_setsid_child_dies_on_timeout(tmp_path, authority, mode):
    with layout_in_mode(tmp_path, authority, mode, {"kill_grace_ms": 300}) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                call_id = await session.call("start_process", {"command": ESCAPES, "timeout_ms": 1000}, idempotency_key="h1")
                started = await session.result(call_id)
                assert started["ok"], started
                # The holder put the process in the call's own cgroup before it ran.
                placed = membership_of(started['result']['pid'], mode)
                assert os.path.basename(placed) == held_cgroup_name(daemon, call_id)
                pid_file = layout.workspace / "escaped.pid"
                with trio.fail_after(DEADLINE_S):
                    while not pid_file.exists():
                        await trio.sleep(POLL_S)
                escaped = int(pid_file.read_text())
                try:
                    completed = await _held_completed(session, call_id)
                    assert completed["timed_out"] is True
                    await wait_dead(escaped)  # left the group with setsid, not the cgroup
                finally:
                    kill_quietly(escaped)


def held_host(daemon: Any) -> ProcessHost:
    """An in-process daemon's held processes."""
    assert daemon.supervisor is not None and daemon.supervisor.processes is not None
    return daemon.supervisor.processes


def held_cgroup_name(daemon: Any, call_id: str) -> str:
    """The name of a running held process's cgroup (its call_id, or a ready one's)."""
    cgroup = held_host(daemon).processes[call_id].cgroup
    assert cgroup is not None
    return cgroup.name


def daemon_cgroups(daemon: Any) -> cgroups.Cgroups:
    """An in-process daemon's cgroups (its mode's)."""
    assert daemon.supervisor is not None and daemon.supervisor.cgroups is not None
    return daemon.supervisor.cgroups


@pytest.mark.parametrize("mode", MODES)
async def test_an_ended_held_processs_cgroup_is_removed_off_the_event_loop(tmp_path, authority, mode, monkeypatch):
    """An rmdir of a cgroup can wait milliseconds for the kernel to take the group offline:
    the held process's tending hands it to a worker thread, never the event loop's, which
    serves every session meanwhile."""
    removals = record_removals(monkeypatch)
    with layout_in_mode(tmp_path, authority, mode) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                # It runs until its stdin ends, so that its cgroup can be read first.
                call_id = await session.call("start_process", {"command": "cat > /dev/null; exit 3"}, idempotency_key="h-rm")
                started = await session.result(call_id)
                assert started["ok"], started
                name = held_cgroup_name(daemon, call_id)
                membership = membership_of(started['result']['pid'], mode)
                await session.close_stdin(call_id, 0)
                assert (await _held_completed(session, call_id))["exit_code"] == 3
                with trio.fail_after(DEADLINE_S):
                    # Removed, not just attempted: the process's cgroup directory is gone.
                    while name not in {removed for removed, _ in removals} or any(
                        cgroup.name == name for cgroup in daemon_cgroups(daemon).existing()
                    ):
                        await trio.sleep(POLL_S)
    assert membership.endswith("/" + name), membership
    held = [on_loop for removed, on_loop in removals if removed == name]
    assert held and not any(held), removals


# A held process that leaves a child with stdio of its own behind, in its cgroup.
DETACHES = (
    "setsid -f sh -c 'echo $$ > escaped.tmp; mv escaped.tmp escaped.pid; exec sleep 300'"
    " < /dev/null > /dev/null 2>&1; exit 0"
)


@pytest.mark.parametrize("mode", MODES)
async def test_a_stop_ends_a_detached_descendant_of_an_ended_held_process(tmp_path, authority, mode):
    """The process and its holder ended, but a child it started with setsid and its own
    stdio runs on in the cgroup: the cgroup's removal (in a worker thread) finds it busy and
    keeps it, and the stop ends the child."""
    with layout_in_mode(tmp_path, authority, mode) as layout:
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                call_id = await _held_ran(session, DETACHES, "h-detached")
                pid_file = layout.workspace / "escaped.pid"
                host = held_host(daemon)
                with trio.fail_after(DEADLINE_S):
                    # Its tending is over (the holder gone) and the busy cgroup kept.
                    while not pid_file.exists() or call_id in host.processes or not host.lingering:
                        await trio.sleep(POLL_S)
                escaped = int(pid_file.read_text())
                assert alive(escaped)
                placed = membership_of(escaped, mode)
                assert [cgroup.name for cgroup in host.lingering] == [os.path.basename(placed)]
        try:
            await wait_dead(escaped)  # the daemon's stop ended it
        finally:
            kill_quietly(escaped)


@pytest.mark.parametrize("mode", MODES)
async def test_a_stop_ends_a_descendant_whose_cgroup_was_being_removed(tmp_path, authority, mode, monkeypatch):
    """The held process ended and its cgroup's removal (a worker thread's) was still under way
    when the stop swept the lingering cgroups: the removal, finding the cgroup busy after the
    sweep, ends the descendant itself."""
    held: dict[str, Any] = {}  # the process host
    # Per removal in a worker thread, each held until the stop has swept: the cgroup's name,
    # and whether the stop had swept by then.
    order: list[tuple[str, bool]] = []
    remove = cgroups.CommandCgroup.remove

    def after_the_sweep(self: cgroups.CommandCgroup) -> bool:
        if threading.current_thread() is not threading.main_thread():
            deadline = time.monotonic() + DEADLINE_S
            while not held["host"]._swept and time.monotonic() < deadline:
                time.sleep(POLL_S)  # a worker thread: the event loop goes on meanwhile
            order.append((self.name, held["host"]._swept))
        return remove(self)

    monkeypatch.setattr(cgroups.CommandCgroup, "remove", after_the_sweep)
    with layout_in_mode(tmp_path, authority, mode) as layout:
        async with in_process_daemon(layout) as daemon:
            host = held["host"] = held_host(daemon)
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                call_id = await _held_ran(session, DETACHES, "h-swept")
                pid_file = layout.workspace / "escaped.pid"
                with trio.fail_after(DEADLINE_S):
                    # Its tending has forgotten it and is removing its cgroup.
                    while not pid_file.exists() or call_id in host.processes:
                        await trio.sleep(POLL_S)
                escaped = int(pid_file.read_text())
                name = os.path.basename(membership_of(escaped, mode))
                assert alive(escaped) and not host.lingering
        try:
            await wait_dead(escaped)  # ended by the removal, after the stop's sweep
        finally:
            kill_quietly(escaped)
    # The busy removal, then the one after the kill, both of this process's cgroup.
    assert [entry for entry in order if entry[0] == name] == [(name, True), (name, True)], order


@pytest.mark.parametrize("mode", MODES)
async def test_a_held_process_in_a_cgroup_made_ahead_is_kept_and_adopted_after_a_kill_9(tmp_path, authority, mode):
    """A start takes a cgroup made ahead (its mkdirs off the start's path), whose name is not
    the call's: the record keeps it, so a daemon started after a kill -9 keeps that cgroup
    and its process (they are no leftovers) and adopts the cgroup by that name: what the
    process left in it (a child with its own session and stdio) is ended by the stop."""
    leaves_then_waits = DETACHES.replace("; exit 0", "; exec cat")
    with layout_in_mode(tmp_path, authority, mode) as layout:
        pid_file = layout.workspace / "escaped.pid"
        async with running_daemon(layout) as process:
            client = process.running.client()
            async with client.connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                # The first start makes its own cgroup (and the refill of the ready ones
                # begins); a later one takes a ready one once there is one.
                with trio.fail_after(DEADLINE_S):
                    for attempt in itertools.count():
                        call_id = await session.call("start_process", {"command": "cat"}, idempotency_key=f"ahead-{attempt}")
                        started = await session.result(call_id)
                        assert started["ok"], started
                        placed = membership_of(started['result']['pid'], mode)
                        await session.close_stdin(call_id, 0)
                        await _held_completed(session, call_id)
                        if os.path.basename(placed).startswith(READY_PREFIX):
                            break
                    call_id = await session.call("start_process", {"command": leaves_then_waits}, idempotency_key="ahead-kept")
                    started = await session.result(call_id)
                    assert started["ok"], started
                    pid = started["result"]["pid"]
                    placed = membership_of(pid, mode)
                    while not pid_file.exists():
                        await trio.sleep(POLL_S)
            escaped = int(pid_file.read_text())
            try:
                assert os.path.basename(placed).startswith(READY_PREFIX), placed
                client.endpoint = (await process.kill_and_start()).tcp
                async with client.connect() as session:
                    await session.bootstrap(cwd=str(layout.workspace))
                    assert alive(pid) and alive(escaped)  # not ended as leftovers of the killed daemon
                    assert membership_of(escaped, mode) == placed
                    await session.close_stdin(call_id, 0)  # adopted: its holder answers
                    assert (await _held_completed(session, call_id))["exit_code"] == 0
                    assert alive(escaped)
            except BaseException:
                kill_quietly(escaped)
                kill_quietly(pid)  # a restart that failed leaves no daemon to end it
                raise
        try:
            await wait_dead(escaped)  # the stop ended it, through the adopted cgroup
        finally:
            kill_quietly(escaped)


@needs_v1_memory
async def test_a_held_process_killed_by_its_memory_limit_says_so(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, exec={"memory_max": 32 * MIB})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            grow = f"exec {sys.executable} -c \"x = b'a' * (512 * 1024 * 1024)\""
            call_id = await session.call("start_process", {"command": grow}, idempotency_key="h-oom")
            assert (await session.result(call_id))["ok"]
            completed = await _held_completed(session, call_id)
    assert completed["signal"] == "SIGKILL" and completed["oom_killed"] is True
    ExecCompletedBody.model_validate(completed)


@pytest.mark.parametrize("mode", MODES)
async def test_a_stop_ends_what_an_ended_held_process_left_in_its_cgroup(tmp_path, authority, mode):
    """The process exited, but a child it started with setsid runs on (and keeps its holder,
    which owns the pipes, alive): a stop ends the child too, as it does a command's."""
    with layout_in_mode(tmp_path, authority, mode, {"kill_grace_ms": 300}) as layout:
        leaves = "setsid -f sh -c 'echo $$ > escaped.tmp; mv escaped.tmp escaped.pid; exec sleep 300'; exit 0"
        async with in_process_daemon(layout) as daemon:
            async with daemon.client().connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
                await _held_ran(session, leaves, "h-left")
                pid_file = layout.workspace / "escaped.pid"
                with trio.fail_after(DEADLINE_S):
                    while not pid_file.exists():
                        await trio.sleep(POLL_S)
                escaped = int(pid_file.read_text())
                assert alive(escaped)
        try:
            await wait_dead(escaped)  # the daemon's stop ended it
        finally:
            kill_quietly(escaped)
