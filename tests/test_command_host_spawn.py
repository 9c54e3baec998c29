"""The command host's spawn (`spawner.Spawner`: Popen, with the cgroup and the OOM score
set on the host around it) against the spawn it replaced on the hot path (`holder.spawn`: a
fork running Python code before exec). The same probe runs through both and must print the
same: cwd, environment, ids, session and group, OOM score of the first child, cgroups,
standard descriptors, signal dispositions, exit status. Real processes, real cgroups (the
daemon's automatic cgroup1 choice, and a private cgroup2 mount) where the machine has them."""

from __future__ import annotations

import errno
import os
import pwd
import select
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgroup_support import cgroup1_unavailable, cgroup2_unavailable, private_cgroup2
from sandbox_supervisor.daemon.runtime import cgroups, holder
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec
from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ, read_oom_score_adj
from sandbox_supervisor.daemon.runtime.spawner import Spawner, popen_stage

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "SST_PROBE": "a b\nc"}
DEADLINE_S = 10
# What a command sees of itself, with nothing that differs between two runs (pids, the
# call's cgroup name) printed as such. `cat` is the shell's first child: its OOM score and
# cgroups are those of "the first moments". The signal mask is read by the shell itself (a
# builtin `read`): a shell blocks every signal for a moment around each fork, so a child
# reading its parent's status may see that.
PROBE = r"""
echo "cwd=$(pwd)"
echo "ids=$(id -u) $(id -g) $(id -G)"
echo "oom=$(cat /proc/self/oom_score_adj)"
set -- $(cut -d' ' -f5,6 /proc/$$/stat)
[ "$1" = $$ ] && echo "leads its group"
[ "$2" = $$ ] && echo "leads its session"
echo "stdin=$(readlink /proc/$$/fd/0)"
echo "fds=$(ls /proc/$$/fd | sort -n | tr '\n' ' ')"
while read -r key value; do case $key in SigBlk:|SigIgn:) echo "$key $value";; esac; done </proc/self/status
sed "s/$CALL/CALL/" /proc/self/cgroup
env | grep -v "^CALL=" | sort
echo err >&2
exit 7
"""


def probe_spec(cwd: Path, cgroup: cgroups.CommandCgroup | None = None, **ids: object) -> HolderSpec:
    env = {**ENV, "CALL": "none" if cgroup is None else cgroup.name}
    return HolderSpec(
        argv=("/bin/sh", "-c", PROBE),
        cwd=str(cwd),
        env=env,
        stdin="null",
        oom_score_adj=COMMAND_OOM_SCORE_ADJ,
        cgroup=None if cgroup is None else cgroup.membership,
        cgroup_also=() if cgroup is None else tuple(d for d in cgroup.directories() if d != cgroup.membership),
        **ids,  # type: ignore[arg-type]
    )


def drain_and_reap(pid: int, outputs: dict[str, int]) -> tuple[bytes, bytes, int]:
    """Read the stdout and stderr pipes (`outputs`, by name) to their end, close them, and
    reap `pid`: both outputs and the wait status."""
    data = {fd: bytearray() for fd in outputs.values()}
    open_fds = set(data)
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], DEADLINE_S)
        assert ready, "the command did not finish"
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                data[fd] += chunk
            else:
                open_fds.discard(fd)
                os.close(fd)
    _, status = os.waitpid(pid, 0)
    return bytes(data[outputs["stdout"]]), bytes(data[outputs["stderr"]]), status


def run(spawn: object, spec: HolderSpec) -> tuple[bytes, bytes, int]:
    """Spawn with `spawn(spec, stdio)`, read both pipes to their end, reap; the outputs and
    the wait status."""
    stdio = holder.open_stdio(spec)
    pid = spawn(spec, stdio)  # type: ignore[operator]
    return drain_and_reap(pid, dict(stdio.outputs))


def drop_fds(result: tuple[bytes, bytes, int]) -> tuple[bytes, bytes, int]:
    stdout = b"".join(line for line in result[0].splitlines(keepends=True) if not line.startswith(b"fds="))
    return stdout, result[1], result[2]


def refuse_the_old_spawn(spec: HolderSpec, stdio: holder.Stdio) -> int:
    raise AssertionError("the Spawner fell back to holder.spawn")


@contextmanager
def fast_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spawner]:
    """A Spawner that must not fall back: the new path is what is measured."""
    spawner = Spawner()
    with monkeypatch.context() as patch:
        patch.setattr(holder, "spawn", refuse_the_old_spawn)
        yield spawner


def own_state() -> tuple[int, str]:
    return read_oom_score_adj(), Path("/proc/self/cgroup").read_text()


def cgroup_modes() -> list[object]:
    return [
        pytest.param("none"),
        pytest.param("cgroup1", marks=pytest.mark.skipif(bool(cgroup1_unavailable()), reason=str(cgroup1_unavailable()))),
        pytest.param("cgroup2", marks=pytest.mark.skipif(bool(cgroup2_unavailable()), reason=str(cgroup2_unavailable()))),
    ]


@contextmanager
def command_cgroups(mode: str, state_dir: Path) -> Iterator[cgroups.Cgroups | None]:
    if mode == "none":
        yield None
    elif mode == "cgroup2":
        with private_cgroup2() as root:
            groups = cgroups.detect("auto", str(root), state_dir, memory_max=1 << 30, pids_max=1024)
            try:
                yield groups
            finally:
                groups.kill_leftovers()
                groups.close()
    else:
        groups = cgroups.detect("auto", None, state_dir, memory_max=1 << 30, pids_max=1024)
        assert groups.mode == "cgroup1"
        try:
            yield groups
        finally:
            groups.kill_leftovers()
            groups.close()


@pytest.mark.parametrize("mode", cgroup_modes())
def test_a_command_sees_the_same_through_popen_as_through_the_old_spawn(tmp_path, monkeypatch, mode):
    cwd = tmp_path / "work dir"
    cwd.mkdir()
    before = own_state()
    with command_cgroups(mode, tmp_path / "state") as groups:
        old_cgroup = None if groups is None else groups.create("old")
        old = run(holder.spawn, probe_spec(cwd, old_cgroup))
        new_cgroup = None if groups is None else groups.create("new")
        with fast_only(monkeypatch) as spawner:
            new = run(spawner.spawn, probe_spec(cwd, new_cgroup))
        assert spawner.usable
    # The one difference: the old spawn let the spawner's inheritable descriptors through (here
    # pytest's); Popen closes them (the shell's 3 is its command substitution's pipe).
    fds = [line for line in new[0].decode().splitlines() if line.startswith("fds=")]
    assert fds == ["fds=0 1 2 3 "]
    assert drop_fds(new) == drop_fds(old)
    stdout = new[0].decode()
    assert f"cwd={cwd}\n" in stdout and f"oom={COMMAND_OOM_SCORE_ADJ}\n" in stdout
    assert "leads its group\nleads its session\n" in stdout and "stdin=/dev/null\n" in stdout
    assert "SigBlk: 0000000000000000\n" in stdout
    assert new[1] == b"err\n" and os.waitstatus_to_exitcode(new[2]) == 7
    if groups is not None:
        assert ("0::/" if mode == "cgroup2" else "freezer:/") in stdout and "/CALL\n" in stdout
    # The host is where it was, with its own score: it only passed through.
    assert own_state() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="switching ids needs root")
@pytest.mark.parametrize("groups", [(65534, 0), None], ids=["groups", "no-groups"])
def test_a_command_user_gets_the_same_ids_and_the_rest(tmp_path, monkeypatch, groups):
    nobody = pwd.getpwnam("nobody")
    cwd = tmp_path / "work dir"
    cwd.mkdir()
    os.chmod(tmp_path, 0o700)  # only root may pass: the cwd is entered before the ids change
    ids = {"uid": nobody.pw_uid, "gid": nobody.pw_gid, "groups": groups}
    old = run(holder.spawn, probe_spec(cwd, **ids))
    with fast_only(monkeypatch) as spawner:
        new = run(spawner.spawn, probe_spec(cwd, **ids))
    assert drop_fds(new) == drop_fds(old)
    stdout = new[0].decode()
    line = next(line for line in stdout.splitlines() if line.startswith("ids="))
    uid, gid, *supplementary = line.removeprefix("ids=").split()
    assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
    assert {int(g) for g in supplementary} == {*(groups or ()), nobody.pw_gid}
    assert "SigBlk: 0000000000000000\n" in stdout and f"oom={COMMAND_OOM_SCORE_ADJ}\n" in stdout


def test_a_signal_death_reads_the_same(tmp_path, monkeypatch):
    spec = HolderSpec(argv=("/bin/sh", "-c", "kill -TERM $$"), cwd=str(tmp_path), env=ENV, stdin="null")
    with fast_only(monkeypatch) as spawner:
        _, _, status = run(spawner.spawn, spec)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM


def test_failures_name_their_stage_and_nothing_runs(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    missing_cwd = HolderSpec(argv=("/bin/sh", "-c", f"touch {marker}"), cwd=str(tmp_path / "gone"), env=ENV, stdin="null")
    missing_program = HolderSpec(argv=("sst-no-such-program",), cwd=str(tmp_path), env=ENV, stdin="null")
    before = own_state()
    with fast_only(monkeypatch) as spawner:
        for spec, stage, code in [(missing_cwd, "cwd", errno.ENOENT), (missing_program, "exec", errno.ENOENT)]:
            stdio = holder.open_stdio(spec)
            with pytest.raises(holder.SpawnError) as raised:
                spawner.spawn(spec, stdio)
            assert (raised.value.stage, raised.value.errno) == (stage, code)
            for fd in stdio.outputs.values():
                assert os.read(fd, 1) == b""  # the child's ends are closed: nothing holds them
                os.close(fd)
    assert not marker.exists()
    assert own_state() == before


NOBODY = 65534


def stage_as_nobody(spawn_name: str, spec: HolderSpec) -> str:
    """`stage:errno` of a spawn by a process running as nobody (so that switching to root's
    ids fails in the child), with `Spawner().spawn` or `holder.spawn`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        answer = "none:0"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            spawn = Spawner().spawn if spawn_name == "popen" else holder.spawn
            stdio = holder.open_stdio(spec)
            try:
                spawn(spec, stdio)
                answer = "ran:0"
            except holder.SpawnError as exc:
                answer = f"{exc.stage}:{exc.errno}"
        except BaseException as exc:  # noqa: BLE001 - reported, not raised, in a forked child
            answer = f"error:{exc!r}"
        finally:
            os.write(write_end, answer.encode())
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            answer = reader.read().decode()
    finally:
        os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to nobody: needs root")
def test_a_refused_switch_of_ids_is_the_identity_stage_as_in_the_old_spawn(tmp_path):
    """Popen names the cwd for any failure of its child before exec: a refused setuid was
    reported as the `cwd` stage, as if the directory were the trouble."""
    marker = tmp_path / "ran"  # root's to write: the command would run as root
    spec = HolderSpec(
        argv=("/bin/sh", "-c", f"touch {marker}"), cwd="/", env=ENV, stdin="null", uid=0, gid=0, groups=()
    )
    assert stage_as_nobody("popen", spec) == f"identity:{errno.EPERM}"
    assert stage_as_nobody("holder", spec) == f"identity:{errno.EPERM}"
    assert not marker.exists()


@pytest.mark.skipif(bool(cgroup2_unavailable()), reason=str(cgroup2_unavailable()))
def test_a_cgroup_that_refuses_the_command_stops_the_spawn_and_the_host_goes_home(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    before = own_state()
    with private_cgroup2() as root, fast_only(monkeypatch) as spawner:
        # Removed (as a cgroup a kill-and-remove raced) after the first one was joined.
        (root / "first").mkdir()
        inner = root / "gone"
        spec = HolderSpec(
            argv=("/bin/sh", "-c", f"touch {marker}"), cwd=str(tmp_path), env=ENV, stdin="null",
            oom_score_adj=COMMAND_OOM_SCORE_ADJ, cgroup=str(root / "first"), cgroup_also=(str(inner),),
        )
        stdio = holder.open_stdio(spec)
        with pytest.raises(holder.SpawnError) as raised:
            spawner.spawn(spec, stdio)
        for fd in stdio.outputs.values():
            os.close(fd)
        assert (raised.value.stage, raised.value.errno) == ("cgroup", errno.ENOENT)
        assert own_state() == before  # out of the first again, its own score back
        assert (root / "first" / "cgroup.procs").read_text() == ""
        assert spawner.usable
    assert not marker.exists()


def test_outside_any_cgroup_hierarchy_it_spawns_the_old_way(tmp_path):
    """A directory the host cannot find its way back from is never entered: holder.spawn
    puts the child there itself (and reports the cgroup stage when that fails)."""
    with tempfile.TemporaryDirectory() as nowhere:
        spec = HolderSpec(
            argv=("/bin/sh", "-c", "exit 0"), cwd=str(tmp_path), env=ENV, stdin="null", cgroup=nowhere + "/x"
        )
        stdio = holder.open_stdio(spec)
        with pytest.raises(holder.SpawnError) as raised:
            Spawner().spawn(spec, stdio)
        for fd in stdio.outputs.values():
            os.close(fd)
    assert raised.value.stage == "cgroup"


def _v1_pids_mount() -> str | None:
    try:
        mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None
    mount = mounts.v1.get("pids")
    return mount if mount is not None and os.access(mount, os.W_OK) else None


@pytest.mark.skipif(_v1_pids_mount() is None, reason="needs a writable cgroup v1 pids hierarchy (root)")
def test_a_pids_max_of_one_still_runs_the_command(tmp_path):
    """Review finding: the host joined the command's cgroup before its fork and took the only
    place a pids.max of 1 (which exec.pids_max allows) leaves, so every command failed with
    resource_exhausted. It now falls back to the spawn whose child joins alone."""
    mount = _v1_pids_mount()
    assert mount is not None
    directory = Path(mount) / f"sandbox-supervisor-test-pids1-{os.getpid()}"
    directory.mkdir()
    try:
        (directory / "pids.max").write_text("1")
        spec = HolderSpec(
            argv=("/bin/sh", "-c", "echo ran"), cwd=str(tmp_path), env=ENV, stdin="null",
            oom_score_adj=COMMAND_OOM_SCORE_ADJ, cgroup=str(directory),
        )
        before = own_state()
        spawner = Spawner()
        stdio = holder.open_stdio(spec)
        try:
            pid = spawner.spawn(spec, stdio)
            assert os.read(stdio.outputs["stdout"], 100) == b"ran\n"
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            for fd in stdio.outputs.values():
                os.close(fd)
        assert own_state() == before  # the host is home, at its own score
        assert spawner.usable
    finally:
        directory.rmdir()


def test_a_refused_switch_of_ids_named_by_no_file_is_still_the_identity_stage():
    """Python 3.13 and later name no file for a failure of Popen's child before exec other
    than its chdir (3.11 and 3.12 name the cwd): the errno still tells a refused switch of
    ids from the fork's own failure (review finding)."""
    with_ids = HolderSpec(argv=("/bin/true",), cwd="/", env=ENV, stdin="null", uid=65534, gid=65534)
    without = HolderSpec(argv=("/bin/true",), cwd="/", env=ENV, stdin="null")
    assert popen_stage(OSError(errno.EPERM, "refused"), with_ids) == "identity"
    assert popen_stage(OSError(errno.EAGAIN, "no process"), with_ids) == "fork"
    assert popen_stage(OSError(errno.EPERM, "refused"), without) == "fork"
    assert popen_stage(OSError(errno.EPERM, "refused", "/"), with_ids) == "identity"
    assert popen_stage(OSError(errno.ENOENT, "gone", "/"), with_ids) == "cwd"
    assert popen_stage(OSError(errno.ENOENT, "gone", "/bin/sh"), with_ids) == "exec"
