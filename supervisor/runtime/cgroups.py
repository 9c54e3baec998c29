"""One cgroup per command: where the daemon may make them, limits, kill by cgroup, OOM kills
(docs/operations.md, "Process isolation"; docs/protocol.md §7.4.1).

A process group ends with its members, but a member that calls setsid() (`setsid -f`, a
daemonising server) leaves it and outlives a timeout or a stop. A cgroup cannot be left by an
unprivileged process: every descendant of a command stays in the command's cgroup, so the
daemon signals the cgroup's members and kills whatever is left with `cgroup.kill` (v2), or by
freezing the cgroup and killing its members (v1 freezer), which no fork can race.

Three modes, chosen once at start (`choose_plan`):
- `cgroup2`: a cgroup v2 directory the daemon may manage — `[exec] cgroup_root`, or the
  daemon's own cgroup when systemd delegated it (`Delegate=yes`). Command cgroups live under
  `<root>/<base_name(state_dir)>/<call_id>`; when the daemon itself is a member of the root,
  it first moves into the leaf `<root>/supervisor` (a cgroup that enables controllers for its
  children may hold no processes). `memory.max`/`pids.max` come from the v2 controllers when
  the root offers them, else from the v1 `memory`/`pids` hierarchies when mounted.
- `cgroup1`: no usable v2 directory, but the v1 `freezer` hierarchy is mounted and writable:
  membership and the kill go through it, limits through v1 `memory`/`pids`. Command cgroups
  are children of the daemon's own cgroup in each hierarchy, so its limits keep applying.
- `process-group`: neither (or `[exec] cgroup = "off"`): process groups alone, as before.

Standard library only: the per-process holder imports this module, and it must not load
pydantic, trio or structlog (a test checks). Decisions (parsing /proc and cgroup files, the
choice of mode and paths) are pure functions; the file-system side is kept thin.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MODE_CGROUP2 = "cgroup2"
MODE_CGROUP1 = "cgroup1"
MODE_PROCESS_GROUP = "process-group"
SETTING_AUTO = "auto"
SETTING_OFF = "off"

# The v1 hierarchies the daemon uses: freezer for membership and the race-free kill, memory
# and pids for the limits.
V1_FREEZER = "freezer"
V1_MEMORY = "memory"
V1_PIDS = "pids"
V1_CONTROLLERS = (V1_FREEZER, V1_MEMORY, V1_PIDS)
# v2 controllers that carry the limits.
V2_LIMIT_CONTROLLERS = ("memory", "pids")
# The leaf the daemon moves into when it is a member of the root it manages ("no internal
# processes": a cgroup that hands controllers to its children may hold no process itself).
DAEMON_LEAF = "supervisor"
# Command cgroups of one daemon live in one directory named after its state directory, so two
# daemons sharing a root (tests, a second instance) never touch each other's commands, and a
# restarted daemon finds exactly its predecessor's leftovers there.
BASE_PREFIX = "sandbox-supervisor."
BASE_DIGEST_CHARS = 12
# systemd (since v251) marks a delegated cgroup with this extended attribute ("1"): trusted.
# for system units, user. for user units.
DELEGATE_XATTRS = ("trusted.delegate", "user.delegate")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_SELF_MOUNTINFO = Path("/proc/self/mountinfo")
# Freezing a v1 cgroup is asynchronous (freezer.state reads FREEZING until every task
# stopped): how long the kill waits for FROZEN, and how often it looks.
FREEZE_TIMEOUT_S = 2.0
FREEZE_POLL_S = 0.005
# Kill-and-look rounds over a cgroup whose members must all die (v1 without a settled freeze;
# leftovers at start).
KILL_ROUNDS = 50
KILL_ROUND_PAUSE_S = 0.01
# How long a leftover cgroup is given to empty after its kill before its removal is tried.
LEFTOVER_EMPTY_TIMEOUT_S = 2.0
UNLIMITED = "max"


# --- pure decisions ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcCgroup:
    """/proc/PID/cgroup: the unified (v2) path, and each v1 controller's path."""

    unified: str | None
    v1: Mapping[str, str]


def parse_proc_cgroup(text: str) -> ProcCgroup:
    """Lines `ID:CONTROLLERS:PATH`; the v2 line is `0::PATH`. A v1 line may name several
    controllers (`cpu,cpuacct`) or a named hierarchy (`name=systemd`, ignored)."""
    unified: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
            continue
        for name in controllers.split(","):
            if name and not name.startswith("name="):
                v1[name] = path
    return ProcCgroup(unified, v1)


@dataclass(frozen=True, slots=True)
class CgroupMounts:
    """Where the hierarchies are mounted: every cgroup2 mount point whose root is the
    hierarchy's root, and each v1 controller's mount point."""

    unified: tuple[str, ...]
    v1: Mapping[str, str]


def _unescape_mount(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1 : i + 4].isdigit() and len(text[i + 1 : i + 4]) == 3:
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> CgroupMounts:
    """/proc/self/mountinfo: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE
    SOURCE SUPEROPTS`. Only mounts of a hierarchy's root ("/") count: a bind mount of a
    subtree would put the paths of /proc/self/cgroup in the wrong place."""
    unified: list[str] = []
    v1: dict[str, str] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, mount_point, fstype = fields[3], _unescape_mount(fields[4]), rest[0]
        if root != "/":
            continue
        if fstype == "cgroup2":
            unified.append(mount_point)
        elif fstype == "cgroup":
            for option in rest[2].split(","):
                if option in V1_CONTROLLERS and option not in v1:
                    v1[option] = mount_point
    return CgroupMounts(tuple(unified), v1)


def parse_keyed(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (`cgroup.events`, `memory.events`, v1 `memory.oom_control`):
    `key value` lines; values that are not integers are left out."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                values[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return values


def parse_procs(text: str) -> list[int]:
    """`cgroup.procs`: one pid a line."""
    return [int(line) for line in text.split() if line.isdigit()]


def base_name(state_dir: str | os.PathLike[str]) -> str:
    """The directory of one daemon's command cgroups, named after its state directory."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(state_dir))).hexdigest()
    return BASE_PREFIX + digest[:BASE_DIGEST_CHARS]


def hierarchy_path(mount_point: str, cgroup_path: str) -> str:
    """A /proc/PID/cgroup path under its mount point."""
    return os.path.join(mount_point, cgroup_path.lstrip("/")).rstrip("/") or "/"


@dataclass(frozen=True, slots=True)
class V2Facts:
    """What the file system says about a cgroup v2 candidate directory."""

    path: str
    usable: bool  # a cgroup v2 directory the daemon can write (create children in)
    delegated: bool  # explicitly configured, or marked delegated by systemd
    controllers: frozenset[str] = frozenset()  # its cgroup.controllers
    daemon_inside: bool = False  # the daemon is a member of `path` itself
    is_hierarchy_root: bool = False  # the whole machine's (or container's) root cgroup


@dataclass(frozen=True, slots=True)
class Plan:
    """The mode and where everything goes; `problem` set when an explicit root is unusable."""

    mode: str
    v2_root: str | None = None  # cgroup2: the managed root
    move_daemon_to: str | None = None  # cgroup2: the leaf the daemon moves into first
    v2_limits: frozenset[str] = frozenset()  # controllers to enable under the root
    v1_parents: Mapping[str, str] = field(default_factory=dict)  # controller → parent dir
    memory_max: int | None = None  # what is enforced, None: not
    pids_max: int | None = None
    problem: str | None = None
    # Why an automatic choice ended in process-group after all (its preparation failed).
    fallback: str | None = None


def choose_plan(
    setting: str,
    explicit_root: str | None,
    v2: V2Facts | None,
    v1_writable: Mapping[str, str],
    memory_max: int | None,
    pids_max: int | None,
) -> Plan:
    """Pick the mode (module docstring).

    `v2`: the facts of `explicit_root` when one is configured, else of the daemon's own v2
    cgroup (None without a mounted unified hierarchy). `v1_writable`: controller → the
    daemon's own cgroup directory in that v1 hierarchy, for each one mounted and writable.
    An explicit root that is unusable is a problem (the operator asked for it), never a
    silent fallback."""
    if setting == SETTING_OFF:
        return Plan(MODE_PROCESS_GROUP)
    root: str | None = None
    move_to: str | None = None
    if explicit_root is not None:
        if v2 is None or not v2.usable:
            return Plan(MODE_PROCESS_GROUP, problem=f"{explicit_root} is not a writable cgroup v2 directory")
        root = v2.path
    elif v2 is not None and v2.usable and v2.delegated and not v2.is_hierarchy_root:
        root = v2.path
    if root is not None and v2 is not None:
        if v2.daemon_inside:
            move_to = os.path.join(root, DAEMON_LEAF)
        wanted = {"memory": memory_max, "pids": pids_max}
        v2_limits = frozenset(name for name in V2_LIMIT_CONTROLLERS if wanted[name] is not None and name in v2.controllers)
        v1_parents = {
            name: v1_writable[name]
            for name in (V1_MEMORY, V1_PIDS)
            if wanted[name] is not None and name not in v2_limits and name in v1_writable
        }
        return Plan(
            MODE_CGROUP2,
            v2_root=root,
            move_daemon_to=move_to,
            v2_limits=v2_limits,
            v1_parents=v1_parents,
            memory_max=memory_max if ("memory" in v2_limits or V1_MEMORY in v1_parents) else None,
            pids_max=pids_max if ("pids" in v2_limits or V1_PIDS in v1_parents) else None,
        )
    if V1_FREEZER in v1_writable:
        parents = {V1_FREEZER: v1_writable[V1_FREEZER]}
        if memory_max is not None and V1_MEMORY in v1_writable:
            parents[V1_MEMORY] = v1_writable[V1_MEMORY]
        if pids_max is not None and V1_PIDS in v1_writable:
            parents[V1_PIDS] = v1_writable[V1_PIDS]
        return Plan(
            MODE_CGROUP1,
            v1_parents=parents,
            memory_max=memory_max if V1_MEMORY in parents else None,
            pids_max=pids_max if V1_PIDS in parents else None,
        )
    return Plan(MODE_PROCESS_GROUP)


def delegated_root(own: str, leaf_delegated: bool, parent_delegated: bool) -> tuple[str, bool] | None:
    """The delegated directory for a daemon whose own v2 cgroup is `own`, and whether the
    daemon is inside it: `own` itself when delegated, or its parent when the daemon already
    sits in the leaf DAEMON_LEAF (moved there by an earlier start, or by systemd's
    DelegateSubgroup=). None when neither is delegated."""
    if leaf_delegated:
        return own, True
    if os.path.basename(own) == DAEMON_LEAF and parent_delegated:
        return os.path.dirname(own), False
    return None


# --- the file system side ----------------------------------------------------------------


# A cgroup file is read whole in one read of this size (cgroup.procs of a command with
# thousands of processes takes more reads, up to the end).
_READ_BYTES = 64 * 1024


def _read(path: str) -> str:
    """A cgroup file's text. os.open and os.read rather than open(): a text file object costs
    an fstat, an isatty ioctl and two lseeks on top of the open, the read and the close, and
    a command's cgroup.procs is read on its path (is the group still alive?)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, _READ_BYTES):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _write(path: str, text: str) -> None:
    # One write() per value: cgroup files take one value per write.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _is_v2_dir(path: str) -> bool:
    # cgroup.controllers exists only in cgroup v2 directories.
    return os.path.isfile(os.path.join(path, "cgroup.controllers")) and os.path.isfile(os.path.join(path, "cgroup.procs"))


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK) and os.access(os.path.join(path, "cgroup.procs"), os.W_OK)


def _delegated(path: str) -> bool:
    for name in DELEGATE_XATTRS:
        try:
            if os.getxattr(path, name).strip() == b"1":
                return True
        except OSError:
            continue
    return False


def _same_directory(a: str, b: str) -> bool:
    # By inode, not by name: the hierarchy may be mounted in several places (the daemon's
    # own path is read under the first mount, a configured root may name another).
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _v2_facts(path: str, explicit: bool, own_dir: str | None, is_root: bool) -> V2Facts:
    usable = _is_v2_dir(path) and _writable(path)
    controllers: frozenset[str] = frozenset()
    if usable:
        try:
            controllers = frozenset(_read(os.path.join(path, "cgroup.controllers")).split())
        except OSError:
            usable = False
    inside = own_dir is not None and _same_directory(own_dir, path)
    return V2Facts(path, usable, explicit or _delegated(path), controllers, inside, is_root)


def gather_and_choose(
    setting: str,
    explicit_root: str | None,
    memory_max: int | None,
    pids_max: int | None,
    *,
    proc_cgroup: str | None = None,
    mountinfo: str | None = None,
) -> Plan:
    """Read /proc/self/cgroup, /proc/self/mountinfo and the candidate directories, then
    `choose_plan`. `proc_cgroup`/`mountinfo`: the texts, for tests."""
    if setting == SETTING_OFF:
        return Plan(MODE_PROCESS_GROUP)
    try:
        own = parse_proc_cgroup(proc_cgroup if proc_cgroup is not None else PROC_SELF_CGROUP.read_text())
        mounts = parse_mountinfo(mountinfo if mountinfo is not None else PROC_SELF_MOUNTINFO.read_text())
    except OSError:
        own, mounts = ProcCgroup(None, {}), CgroupMounts((), {})
    own_dir: str | None = None
    if own.unified is not None and mounts.unified:
        own_dir = hierarchy_path(mounts.unified[0], own.unified)
    v2: V2Facts | None = None
    if explicit_root is not None:
        v2 = _v2_facts(os.path.abspath(explicit_root), True, own_dir, False)
    elif own_dir is not None and own.unified is not None:
        is_root = own.unified in ("/", "")
        parent = os.path.dirname(own_dir)
        found = None if is_root else delegated_root(own_dir, _delegated(own_dir), _delegated(parent))
        if found is not None:
            v2 = _v2_facts(found[0], False, own_dir, False)
            v2 = V2Facts(v2.path, v2.usable, True, v2.controllers, found[1], False)
        else:
            v2 = V2Facts(own_dir, False, False, is_hierarchy_root=is_root)
    v1_writable: dict[str, str] = {}
    for name in V1_CONTROLLERS:
        mount = mounts.v1.get(name)
        path = own.v1.get(name)
        if mount is None or path is None:
            continue
        directory = hierarchy_path(mount, path)
        if os.path.isdir(directory) and _writable(directory):
            v1_writable[name] = directory
    return choose_plan(setting, explicit_root, v2, v1_writable, memory_max, pids_max)


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def _enable_controllers(directory: str, names: Iterable[str]) -> frozenset[str]:
    """Enable `names` for `directory`'s children; the ones that took."""
    enabled = set()
    for name in names:
        try:
            _write(os.path.join(directory, "cgroup.subtree_control"), f"+{name}")
            enabled.add(name)
        except OSError:
            continue
    return frozenset(enabled)


def _pids_in(directory: str) -> list[int]:
    try:
        return parse_procs(_read(os.path.join(directory, "cgroup.procs")))
    except FileNotFoundError:
        return []


def _signal_all(pids: Iterable[int], signum: int) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent += 1
        except (ProcessLookupError, PermissionError):
            continue
    return sent


@dataclass(frozen=True, slots=True)
class CommandCgroup:
    """One command's cgroup: a v2 directory, or v1 directories by controller (freezer among
    them), or both (v2 membership with v1 limits)."""

    name: str
    v2: str | None
    v1: Mapping[str, str]
    v2_memory: bool = False  # memory.max is set in the v2 directory

    @property
    def membership(self) -> str:
        """The directory whose cgroup.procs lists every process of the command."""
        if self.v2 is not None:
            return self.v2
        return self.v1[V1_FREEZER]

    def directories(self) -> list[str]:
        return ([self.v2] if self.v2 is not None else []) + list(self.v1.values())

    def joined_in_order(self) -> tuple[str, ...]:
        """The directories as a spawn names them: the membership first (a spec's `cgroup`),
        then the others (its `cgroup_also`)."""
        return (self.membership, *(d for d in self.directories() if d != self.membership))

    def add(self, pid: int) -> None:
        """Put `pid` in every directory of the command (OSError when one refuses)."""
        for directory in self.directories():
            _write(os.path.join(directory, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        return _pids_in(self.membership)

    def populated(self) -> bool:
        if self.v2 is not None:
            try:
                return parse_keyed(_read(os.path.join(self.v2, "cgroup.events"))).get("populated", 0) != 0
            except FileNotFoundError:
                return False
        return bool(self.pids())

    def signal(self, signum: int) -> int:
        """Send `signum` to every member; how many got it. (A member forking meanwhile may
        leave a child unsignalled: `kill` is the race-free end.)"""
        return _signal_all(self.pids(), signum)

    def kill(self) -> None:
        """SIGKILL every member, race-free: `cgroup.kill` in v2; in v1 the cgroup is frozen
        first, so no member can fork between the listing and its kill."""
        # An empty cgroup is anyone's to remove (root's clean-up, a removal in a worker
        # thread): one that goes while it is killed had nothing left to kill.
        if self.v2 is not None:
            try:
                _write(os.path.join(self.v2, "cgroup.kill"), "1")
                return
            except OSError as exc:
                if not os.path.isdir(self.v2):
                    return  # ENOENT, or ENODEV when it went between the open and the write
                if exc.errno != errno.ENOENT:
                    raise
                # A kernel before 5.14 has no cgroup.kill: kill by listing, in rounds.
            for _ in range(KILL_ROUNDS):
                if not _signal_all(self.pids(), signal.SIGKILL):
                    return
                time.sleep(KILL_ROUND_PAUSE_S)
            return
        freezer = self.v1[V1_FREEZER]
        state = os.path.join(freezer, "freezer.state")
        try:
            _write(state, "FROZEN")
        except FileNotFoundError:
            return
        deadline = time.monotonic() + FREEZE_TIMEOUT_S
        try:
            while _read(state).strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(FREEZE_POLL_S)
        except FileNotFoundError:
            return
        try:
            # Frozen tasks take the SIGKILL at the thaw and fork nothing before it.
            _signal_all(self.pids(), signal.SIGKILL)
        finally:
            try:
                _write(state, "THAWED")
            except FileNotFoundError:
                pass  # gone meanwhile: nothing left to thaw
        # A freeze that did not settle in time may have let a fork through: kill in rounds.
        for _ in range(KILL_ROUNDS):
            if not _signal_all(self.pids(), signal.SIGKILL):
                return
            time.sleep(KILL_ROUND_PAUSE_S)

    def oom_kills(self) -> int:
        """Processes of the command the memory limit OOM-killed (0 when unknown)."""
        try:
            if self.v2 is not None and self.v2_memory:
                return parse_keyed(_read(os.path.join(self.v2, "memory.events"))).get("oom_kill", 0)
            memory = self.v1.get(V1_MEMORY)
            if memory is not None:
                return parse_keyed(_read(os.path.join(memory, "memory.oom_control"))).get("oom_kill", 0)
        except OSError:
            return 0
        return 0

    def remove(self) -> bool:
        """Remove the directories (children first: v1 has no order, v2 none below a
        command); False when one is still busy (a member left) or cannot be removed."""
        done = True
        for directory in self.directories():
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                continue
            except OSError:
                done = False
        return done


@dataclass(frozen=True, slots=True)
class Leftover:
    name: str  # the cgroup's: a call_id, or a ready one's (runtime/ready_cgroups.py)
    processes: int  # killed


class Cgroups:
    """The daemon's cgroups in the chosen mode: `prepare` once at start, then `create` one
    per command. `mode` is `process-group` when there are none (then `create` is never used)."""

    def __init__(self, plan: Plan, state_dir: str | os.PathLike[str], memory_max: int | None, pids_max: int | None) -> None:
        self.plan = plan
        self.base = base_name(state_dir)
        self._memory_max = memory_max
        self._pids_max = pids_max
        self._v2_base: str | None = None
        self._v1_bases: dict[str, str] = {}
        self._v2_limits: frozenset[str] = frozenset()
        # Times `create` found a base directory removed under it and made it again.
        self.bases_restored = 0
        # `create` runs on the event loop and in a worker thread (ready_cgroups.py): one at
        # a time, so a base restored by one is complete (controllers enabled) for the other.
        self._creating = threading.Lock()

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def enabled(self) -> bool:
        return self.plan.mode != MODE_PROCESS_GROUP

    @property
    def memory_max(self) -> int | None:
        """The memory limit actually enforced per command (None: none)."""
        if not self.enabled:
            return None
        if "memory" in self._v2_limits or V1_MEMORY in self._v1_bases:
            return self._memory_max
        return None

    @property
    def pids_max(self) -> int | None:
        if not self.enabled:
            return None
        if "pids" in self._v2_limits or V1_PIDS in self._v1_bases:
            return self._pids_max
        return None

    def describe(self) -> dict[str, object]:
        """The mode and the limits enforced, for the start log and /healthz."""
        root = self.plan.v2_root if self.plan.v2_root is not None else self._v1_bases.get(V1_FREEZER)
        described: dict[str, object] = {"mode": self.mode, "root": root, "memory_max": self.memory_max, "pids_max": self.pids_max}
        if self.plan.fallback is not None:
            described["fallback"] = self.plan.fallback
        return described

    def prepare(self) -> None:
        """Move the daemon into its leaf when needed, enable the limit controllers, create
        the base directories (OSError when the file system refuses)."""
        plan = self.plan
        if plan.v2_root is not None:
            if plan.move_daemon_to is not None:
                _mkdir(plan.move_daemon_to)
                # Writing a pid moves the whole process (every thread) in cgroup v2.
                _write(os.path.join(plan.move_daemon_to, "cgroup.procs"), str(os.getpid()))
            base = os.path.join(plan.v2_root, self.base)
            enabled = _enable_controllers(plan.v2_root, plan.v2_limits)
            _mkdir(base)
            self._v2_limits = _enable_controllers(base, enabled)
            self._v2_base = base
        for name, parent in plan.v1_parents.items():
            base = os.path.join(parent, self.base)
            _mkdir(base)
            self._v1_bases[name] = base

    def create(self, name: str) -> CommandCgroup:
        """A new cgroup for one command, limits set (OSError: nothing is left behind).

        A base directory found missing (ENOENT from the command's mkdir) is made again and
        the creation tried once more; `bases_restored` counts it. Between commands a base is
        empty, and an empty cgroup is anyone's to remove: root's clean-up of "leftover"
        `sandbox-supervisor.*` directories (a test suite's, another daemon's) took this live
        daemon's for one, and until the next start every spawn then failed with `internal`
        `No such file or directory`."""
        with self._creating:
            try:
                return self._create(name)
            except FileNotFoundError:
                if not self._restore_bases():
                    raise
            return self._create(name)

    def _restore_bases(self) -> bool:
        """Make the base directories that are gone again, as `prepare` did (for cgroup2 the
        limit controllers enabled below it); False when none was missing."""
        restored = False
        if self._v2_base is not None and not os.path.isdir(self._v2_base):
            _mkdir(self._v2_base)
            self._v2_limits = _enable_controllers(self._v2_base, self._v2_limits)
            restored = True
        for base in self._v1_bases.values():
            if not os.path.isdir(base):
                _mkdir(base)
                restored = True
        self.bases_restored += restored
        return restored

    def _create(self, name: str) -> CommandCgroup:
        v2 = None if self._v2_base is None else os.path.join(self._v2_base, name)
        v1 = {controller: os.path.join(base, name) for controller, base in self._v1_bases.items()}
        cgroup = CommandCgroup(name, v2, v1, v2_memory="memory" in self._v2_limits)
        try:
            for directory in cgroup.directories():
                os.mkdir(directory)
            self._set_limits(cgroup)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def _set_limits(self, cgroup: CommandCgroup) -> None:
        if cgroup.v2 is not None:
            if "memory" in self._v2_limits and self._memory_max is not None:
                _write(os.path.join(cgroup.v2, "memory.max"), str(self._memory_max))
                # No swap to spill into: the limit is the limit, and an excess OOM-kills.
                _try_write(os.path.join(cgroup.v2, "memory.swap.max"), "0")
            if "pids" in self._v2_limits and self._pids_max is not None:
                _write(os.path.join(cgroup.v2, "pids.max"), str(self._pids_max))
        memory = cgroup.v1.get(V1_MEMORY)
        if memory is not None and self._memory_max is not None:
            _write(os.path.join(memory, "memory.limit_in_bytes"), str(self._memory_max))
            # memsw (memory + swap) must be at least the memory limit; equal: no swap.
            _try_write(os.path.join(memory, "memory.memsw.limit_in_bytes"), str(self._memory_max))
        pids = cgroup.v1.get(V1_PIDS)
        if pids is not None and self._pids_max is not None:
            _write(os.path.join(pids, "pids.max"), str(self._pids_max))

    def existing(self) -> list[CommandCgroup]:
        """The command cgroups under this daemon's base directories (a previous instance's,
        at start)."""
        names: set[str] = set()
        for base in ([self._v2_base] if self._v2_base else []) + list(self._v1_bases.values()):
            try:
                names.update(entry.name for entry in os.scandir(base) if entry.is_dir())
            except FileNotFoundError:
                continue
        return [self.adopt(name) for name in sorted(names)]

    def adopt(self, name: str) -> CommandCgroup:
        """The cgroup named `name` as this daemon would have created it."""
        v2 = None if self._v2_base is None else os.path.join(self._v2_base, name)
        v1 = {controller: os.path.join(base, name) for controller, base in self._v1_bases.items()}
        return CommandCgroup(name, v2, v1, v2_memory="memory" in self._v2_limits)

    def kill_leftovers(self, keep: Iterable[str] = ()) -> list[Leftover]:
        """Kill every process of the command cgroups a previous instance left (except those
        named in `keep`), and remove the cgroups."""
        kept = set(keep)
        found = []
        for cgroup in self.existing():
            if cgroup.name in kept:
                continue
            count = len(cgroup.pids()) if os.path.isdir(cgroup.membership) else 0
            if count:
                cgroup.kill()
                deadline = time.monotonic() + LEFTOVER_EMPTY_TIMEOUT_S
                while cgroup.populated() and time.monotonic() < deadline:
                    time.sleep(KILL_ROUND_PAUSE_S)
            cgroup.remove()
            found.append(Leftover(cgroup.name, count))
        return found

    def close(self) -> None:
        """Remove the command cgroups left empty (a stop ends commands but may not wait for
        each to be forgotten), then the base directories when empty; busy ones stay for the
        next start."""
        for cgroup in self.existing():
            cgroup.remove()
        for base in ([self._v2_base] if self._v2_base else []) + list(self._v1_bases.values()):
            try:
                os.rmdir(base)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
                    raise


def _try_write(path: str, text: str) -> None:
    try:
        _write(path, text)
    except OSError:
        # Optional files (no swap accounting, memory.swap.max without swap): nothing to limit.
        pass


def detect(
    setting: str,
    explicit_root: str | None,
    state_dir: str | os.PathLike[str],
    memory_max: int | None = None,
    pids_max: int | None = None,
) -> Cgroups:
    """Choose the mode and prepare it; ValueError (with the reason) when an explicit root is
    unusable or cannot be prepared. An automatic choice that cannot be prepared falls back to
    process groups."""
    plan = gather_and_choose(setting, explicit_root, memory_max, pids_max)
    if plan.problem is not None:
        raise ValueError(plan.problem)
    cgroups = Cgroups(plan, state_dir, memory_max, pids_max)
    try:
        cgroups.prepare()
    except OSError as exc:
        if explicit_root is not None:
            raise ValueError(f"{explicit_root}: {exc.strerror or exc}") from None
        fallback = f"{plan.mode} could not be prepared: {exc.strerror or exc}"
        return Cgroups(Plan(MODE_PROCESS_GROUP, fallback=fallback), state_dir, memory_max, pids_max)
    return cgroups
