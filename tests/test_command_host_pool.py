"""Pre-started shells (`command_host.ShellPool`, docs/internals.md "Pre-started shells"): a
command run by a pooled shell against the same command run by a fresh `bash -c` through
the host's Spawner. The same probe runs through both and must print the same, apart from a
documented list of differences, each pinned here so that a change is noticed. Real
processes, real cgroups where the machine has them, a real unprivileged command user."""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.runtime import cgroups, command_host, holder
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec
from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ
from sandbox_supervisor.daemon.runtime.shell import in_cgroup
from sandbox_supervisor.daemon.runtime.spawner import Spawner
from test_command_host_spawn import DEADLINE_S, cgroup_modes, command_cgroups, drain_and_reap, fast_only

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "SST_PROBE": "a b\nc", "LC_ALL": "C"}
# bash's own variables that differ in a pooled shell (docs/protocol.md, 7.4.1): the -c string
# (the stub's), SECONDS (assigned: `declare -p` shows its value), PIPESTATUS (set by the
# stub's commands); BASHPID is compared as pid=PID below.
DOCUMENTED_VARIABLES = ("BASH_EXECUTION_STRING", "SECONDS", "PIPESTATUS")
# What a command sees of itself and of its shell, with the call's cgroup name printed as such.
# Builtins only where the shell itself is read (a child would see its own state).
PROBE = r"""
echo "args=$_ $0 $# $- seconds=$SECONDS lineno=$LINENO"
echo "cwd=$(pwd)"
echo "ids=$(id -u) $(id -g) $(id -G)"
echo "oom=$(cat /proc/self/oom_score_adj)"
set -- $(cut -d' ' -f5,6 /proc/$$/stat)
[ "$1" = $$ ] && echo "leads its group"
[ "$2" = $$ ] && echo "leads its session"
echo "pid=$$ bashpid=$BASHPID"
echo "stdin=$(readlink /proc/$$/fd/0)"
fds=(/proc/$$/fd/*); echo "fds=${fds[*]##*/}"
while read -r key value; do case $key in SigBlk:|SigIgn:|SigCgt:) echo "$key $value";; esac; done </proc/$$/status
while read -r key value; do case $key in SigBlk:|SigIgn:|SigCgt:) echo "child $key $value";; esac; done < <(cat /proc/self/status)
sed "s/$CALL/CALL/" /proc/self/cgroup
env -0 | tr '\0' '\n' | grep -v "^CALL=" | sort
declare -p | grep -Ev "^declare -[-a-zA-Z]* (BASH_EXECUTION_STRING|SECONDS|PIPESTATUS|BASHPID|CALL|fds|key|value)(=|$)"
umask; ulimit -a; trap -p; shopt -p; set -o
echo err >&2
exit 7
"""


def spec_for(command: str, cwd: Path, cgroup=None, env=None, **ids: object) -> HolderSpec:
    env = {**(env or ENV), "CALL": "none" if cgroup is None else cgroup.name}
    return HolderSpec(
        argv=("/bin/bash", "-c", command),
        cwd=str(cwd),
        env=env,
        stdin="null",
        oom_score_adj=COMMAND_OOM_SCORE_ADJ,
        cgroup=None if cgroup is None else cgroup.membership,
        cgroup_also=() if cgroup is None else tuple(d for d in cgroup.directories() if d != cgroup.membership),
        **ids,  # type: ignore[arg-type]
    )


def collect(pid: int, outputs: dict[str, int]) -> tuple[str, str, int]:
    """Read both pipes to their end and reap: stdout, stderr, the Popen-style return code."""
    stdout, stderr, status = drain_and_reap(pid, outputs)
    return stdout.decode(errors="surrogateescape"), stderr.decode(errors="surrogateescape"), os.waitstatus_to_exitcode(status)


def fresh(spawner: Spawner, spec: HolderSpec) -> tuple[int, tuple[str, str, int]]:
    stdio = holder.open_stdio(spec)
    pid = spawner.spawn(spec, stdio)
    return pid, collect(pid, stdio.outputs)


def pooled(pool: command_host.ShellPool, spec: HolderSpec) -> tuple[int, tuple[str, str, int]]:
    pool.refill(spec)
    shell = pool.take(spec)
    assert shell is not None, "no pooled shell for the spec"
    return shell.pid, collect(shell.pid, shell.outputs)


def normalise(result: tuple[str, str, int], pid: int) -> tuple[str, str, int]:
    stdout, stderr, code = result
    return stdout.replace(f"pid={pid} bashpid={pid}", "pid=PID bashpid=PID"), stderr, code


def compare(spawner, pool, spec_of) -> tuple[tuple[str, str, int], tuple[str, str, int]]:
    """The probe through a fresh shell and a pooled one, pids replaced."""
    pid, old = fresh(spawner, spec_of("old"))
    new_pid, new = pooled(pool, spec_of("new"))
    return normalise(old, pid), normalise(new, new_pid)


@pytest.mark.parametrize("mode", cgroup_modes())
def test_a_probe_sees_the_same_in_a_pooled_shell_as_in_a_fresh_one(tmp_path, monkeypatch, mode):
    cwd = tmp_path / "work dir"
    cwd.mkdir()
    with command_cgroups(mode, tmp_path / "state") as groups, fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            old, new = compare(spawner, pool, lambda name: spec_for(PROBE, cwd, None if groups is None else groups.create(name)))
        finally:
            pool.clear()
    assert new == old
    stdout = new[0]
    assert f"cwd={cwd}\n" in stdout and f"oom={COMMAND_OOM_SCORE_ADJ}\n" in stdout
    assert "leads its group\nleads its session\npid=PID bashpid=PID\n" in stdout and "stdin=/dev/null\n" in stdout
    # Only 0, 1, 2 and the glob's own directory: the command channel was closed.
    assert "fds=0 1 2 3\n" in stdout
    assert stdout.startswith("args=/bin/bash /bin/bash 0 hBc seconds=0 lineno=2\n")
    assert "SST_PROBE=a b\n" in stdout and "declare -x SST_PROBE=$'a b\\nc'\n" in stdout
    assert new[1] == "err\n" and new[2] == 7
    if groups is not None:
        assert ("0::/" if mode == "cgroup2" else "freezer:/") in stdout and "/CALL\n" in stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="switching ids needs root")
def test_a_command_user_gets_the_same_ids_and_the_rest_in_a_pooled_shell(tmp_path, monkeypatch):
    nobody = pwd.getpwnam("nobody")
    cwd = tmp_path / "work dir"
    cwd.mkdir()
    os.chmod(tmp_path, 0o700)  # only root may pass: the cwd is entered before the ids change
    ids = {"uid": nobody.pw_uid, "gid": nobody.pw_gid, "groups": (65534, 0)}
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            old, new = compare(spawner, pool, lambda _name: spec_for(PROBE, cwd, **ids))
        finally:
            pool.clear()
    assert new == old
    assert f"ids={nobody.pw_uid} {nobody.pw_gid} " in new[0]


EXITS = [
    ("true", 0),
    ("exit 7", 7),
    ("kill -TERM $$", -signal.SIGTERM),
    ("sst-no-such-command", 127),
    ("set -e; false; echo not reached", 1),
    ("echo a; if", 2),
    ("f() { return 3; }; f", 3),
    ("return 5", 2),
    ("", 0),
]


@pytest.mark.parametrize(("command", "code"), EXITS, ids=[c or "empty" for c, _ in EXITS])
def test_exit_statuses_are_the_same(tmp_path, monkeypatch, command, code):
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            _, old = fresh(spawner, spec_for(command, tmp_path))
            _, new = pooled(pool, spec_for(command, tmp_path))
        finally:
            pool.clear()
    assert old[2] == new[2] == code
    assert old[0] == new[0]
    # The one difference in the output: bash names a syntax error's source `-c` in a fresh
    # shell and `eval` in a pooled one (documented, docs/protocol.md 7.4.1).
    assert new[1] == old[1].replace("bash: -c: line", "bash: eval: line")


def test_documented_differences_are_what_the_docs_say(tmp_path, monkeypatch):
    """Each difference docs/protocol.md lists, pinned: a change in bash or in the stub that
    moves one is noticed here."""
    cases = {
        "syntax": "if",
        "execution_string": "echo $BASH_EXECUTION_STRING",
        # The last simple command is not exec'd in place of the shell: a child dying of a
        # signal is the shell's exit status 128+N (and bash's job message), not the signal.
        "last_not_execd": "sh -c 'kill -KILL $$'",
        "variables": "declare -p | grep -E '^declare -[-a-z]+ (SECONDS|PIPESTATUS)'",
    }
    results = {}
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            for name, command in cases.items():
                results[name] = (fresh(spawner, spec_for(command, tmp_path)), pooled(pool, spec_for(command, tmp_path)))
        finally:
            pool.clear()
    (_, old), (_, new) = results["syntax"]
    assert "/bin/bash: -c: line 2: syntax error" in old[1] and "/bin/bash: eval: line 2: syntax error" in new[1]
    (_, old), (_, new) = results["execution_string"]
    assert old[0] == "echo $BASH_EXECUTION_STRING\n"
    assert new[0].startswith(f"printf -v {command_host.POOL_UNDERSCORE_VARIABLE} %q")
    (_, old), (_, new) = results["variables"]
    # A fresh shell lists SECONDS without a value and has no PIPESTATUS yet; the stub's
    # commands set both (`declare -p SECONDS` alone reads the same in both).
    assert old[0] == "declare -- SECONDS\n"
    assert new[0] == 'declare -a PIPESTATUS=([0]="0")\ndeclare -- SECONDS="0"\n'

    (_, old), (_, new) = results["last_not_execd"]
    assert old[2] == -signal.SIGKILL and old[1] == ""
    assert new[2] == 128 + signal.SIGKILL and "Killed" in new[1]


def test_the_shell_is_started_before_the_call_and_its_start_time_says_so(tmp_path, monkeypatch):
    """The pid reported in exec.started is the pooled shell's, and its start time (the
    identity restarts check, with the pid) is the shell's real one, from before the call."""
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            pool.refill(spec_for("true", tmp_path))
            waiting = pool.idle[0]
            shell = pool.take(spec_for("echo $$", tmp_path))
            assert shell is not None and shell.pid == waiting.pid
            assert shell.start_ticks == holder._start_ticks(waiting.pid) != 0
            stdout, _, code = collect(shell.pid, shell.outputs)
        finally:
            pool.clear()
    assert (stdout, code) == (f"{waiting.pid}\n", 0)


CGROUP_MODES = [mode for mode in cgroup_modes() if getattr(mode, "values", None) != ("none",)]


def refuse_moves(procs: str, pid: int) -> None:
    raise AssertionError(f"moved {pid} into {procs} on the call's path")


@contextmanager
def pool_in_cgroups(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[cgroups.Cgroups, command_host.ShellPool]]:
    """A one-shell pool on the fast spawner, and real cgroups in `mode` to offer it."""
    with command_cgroups(mode, tmp_path / "state") as groups, fast_only(monkeypatch) as spawner:
        assert groups is not None
        pool = command_host.ShellPool(spawner, 1)
        try:
            yield groups, pool
        finally:
            pool.clear()


@pytest.mark.parametrize("mode", CGROUP_MODES)
def test_an_idle_shell_waits_in_the_cgroup_on_offer_and_its_call_moves_nothing(tmp_path, monkeypatch, mode):
    """runtime/ready_cgroups.py: a cgroup offered with a spawn request gets the next idle
    shell before any call, and the call whose cgroup it is takes that shell as it is."""
    with pool_in_cgroups(mode, tmp_path, monkeypatch) as (groups, pool):
        ahead = groups.create("ready-ahead")
        spec = spec_for("cat /proc/self/cgroup", tmp_path, ahead)
        pool.refill(spec)
        pool.offer([ahead.joined_in_order()])
        assert pool.placing
        pool.place_waiting()
        waiting = pool.idle[0]
        assert not pool.placing and waiting.placed == ahead.joined_in_order()
        assert ahead.pids() == [waiting.pid]  # in it before the call, and alone
        with monkeypatch.context() as patch:
            patch.setattr(command_host, "_move", refuse_moves)
            shell = pool.take(spec)
        assert shell is not None and shell.pid == waiting.pid
        stdout, _, code = collect(shell.pid, shell.outputs)
    assert code == 0
    assert "/ready-ahead\n" in stdout


@pytest.mark.parametrize("mode", CGROUP_MODES)
def test_a_shell_waiting_elsewhere_is_moved_and_its_cgroup_offered_again(tmp_path, monkeypatch, mode):
    """The call's cgroup holds no shell (the daemon took another than the host filled): the
    idle shell is moved in at the call, as without cgroups made ahead, and the cgroup it
    left waits for the next shell."""
    with pool_in_cgroups(mode, tmp_path, monkeypatch) as (groups, pool):
        ahead, other = groups.create("ready-one"), groups.create("ready-two")
        # The command reports its own cgroups: read from `other` after the take, a command
        # that had already ended (a loaded machine) would show no pid there.
        spec = spec_for("cat /proc/self/cgroup", tmp_path)
        pool.refill(spec)
        pool.offer([ahead.joined_in_order()])
        pool.place_waiting()
        shell = pool.take(in_cgroup(spec, other))
        assert shell is not None and ahead.pids() == []
        assert pool.places == [ahead.joined_in_order()]
        stdout, _, code = collect(shell.pid, shell.outputs)
    assert code == 0
    assert "/ready-two\n" in stdout and "/ready-one" not in stdout


@pytest.mark.parametrize("mode", CGROUP_MODES)
def test_a_fresh_spawn_into_a_cgroup_a_shell_waits_in_ends_that_shell(tmp_path, monkeypatch, mode):
    """A command the waiting shell cannot run (another environment here) gets the cgroup
    to itself: the shell is ended, and the cgroup is no longer on offer."""
    with pool_in_cgroups(mode, tmp_path, monkeypatch) as (groups, pool):
        ahead = groups.create("ready-taken")
        pool.refill(spec_for("true", tmp_path))
        pool.offer([ahead.joined_in_order()])
        pool.place_waiting()
        waiting = pool.idle[0]
        other = in_cgroup(spec_for("true", tmp_path, env={**ENV, "X": "1"}), ahead)
        pool.claim(other)
        assert pool.take(other) is None
        pool.vacate(other)
        assert not pool.idle
        # Gone and reaped before the fresh spawn: a zombie would still count against
        # the cgroup's pids.max.
        with pytest.raises(ChildProcessError):
            os.waitpid(waiting.pid, os.WNOHANG)
        assert ahead.pids() == []


@pytest.mark.parametrize("mode", CGROUP_MODES)
def test_an_idle_shell_offered_a_cgroup_that_went_waits_on_unharmed(tmp_path, monkeypatch, mode):
    with pool_in_cgroups(mode, tmp_path, monkeypatch) as (groups, pool):
        gone = groups.create("ready-gone")
        pool.refill(spec_for("true", tmp_path))
        waiting = pool.idle[0]
        pool.offer([gone.joined_in_order()])
        assert gone.remove()  # root's clean-up of empty cgroups, from outside
        pool.place_waiting()
        assert pool.idle == [waiting] and pool.places == [] and not pool.placing


@pytest.mark.parametrize("mode", CGROUP_MODES)
def test_a_refused_placement_gives_up_the_cgroup_and_never_repeats(tmp_path, monkeypatch, mode):
    """The host's loop places whenever a shell waits unplaced and a cgroup is on offer: a
    move refused for a reason that stays (EACCES here) must give up the cgroup, or the loop
    would come back to the same failure at once, forever."""
    with pool_in_cgroups(mode, tmp_path, monkeypatch) as (groups, pool):
        refusing = groups.create("ready-refusing")
        pool.refill(spec_for("true", tmp_path))
        waiting = pool.idle[0]
        pool.offer([refusing.joined_in_order()])

        def refuse(procs: str, pid: int) -> None:
            raise PermissionError(errno.EACCES, "refused", procs)

        with monkeypatch.context() as patch:
            patch.setattr(command_host, "_move", refuse)
            pool.place_waiting()
        assert pool.idle == [waiting] and pool.places == [] and not pool.placing


def test_a_calls_cgroup_is_never_offered_again(tmp_path):
    """`claim`: once a spawn names a cgroup, an offer of it (one still on its way when the
    call was sent) is refused, and one on offer is withdrawn."""
    pool = command_host.ShellPool(Spawner(), 1)
    early, late = ("/cg/early", "/v1/early"), ("/cg/late",)
    pool.offer([early])
    pool.claim(spec_for("true", tmp_path)._replace(cgroup=early[0], cgroup_also=early[1:]))
    pool.claim(spec_for("true", tmp_path)._replace(cgroup=late[0]))
    assert pool.places == []
    pool.offer([early, late, ("/cg/other",)])
    assert pool.places == [("/cg/other",)]


def test_places_from_a_request_are_lists_of_absolute_directories_or_nothing():
    assert command_host.parse_places([["/a", "/b"], ["/c"]]) == [("/a", "/b"), ("/c",)]
    for bad in (None, "/a", [["a"]], [[]], [[1]], [["/a", None]], {"/a": 1}):
        assert command_host.parse_places(bad) == [], bad


def test_idle_shells_are_placed_only_once_no_young_command_runs(tmp_path):
    """A move may wait a grace period, and the host reports no exit meanwhile: it waits
    until every running command is PLACE_AFTER_RUN_S old (an exited one does not count)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        host = command_host.Host(ours)
        assert host._placing_due() == 0.0
        spec = spec_for("true", tmp_path)
        young = command_host.Hosted("young", tmp_path, spec, 1, {})
        host.commands["young"] = young
        due = host._placing_due()
        assert 0 < due <= command_host.PLACE_AFTER_RUN_S
        young.started -= command_host.PLACE_AFTER_RUN_S
        assert host._placing_due() == 0.0
        young.started += command_host.PLACE_AFTER_RUN_S
        young.status = 0  # exited: its report is sent
        assert host._placing_due() == 0.0
    finally:
        ours.close()
        theirs.close()


def test_a_refill_is_due_once_no_command_runs_or_refill_after_s_after_it_was_asked_for():
    wait = command_host.refill_wait
    assert wait(None, 5.0, running=True) is None  # none asked for
    assert wait(None, 5.0, running=False) is None
    assert wait(5.0, 5.0, running=False) == 0.0  # the call's exit is reported: now
    assert wait(5.0, 5.0, running=True) == pytest.approx(command_host.REFILL_AFTER_S)
    assert 0 < wait(5.0, 5.0 + command_host.REFILL_AFTER_S / 2, running=True) < command_host.REFILL_AFTER_S
    assert wait(5.0, 5.0 + command_host.REFILL_AFTER_S, running=True) == 0.0
    assert wait(5.0, 60.0, running=True) == 0.0


def receive_from_host(sock: socket.socket) -> dict:
    """The host's next message; the pipes that come with a `spawned` are closed here (the
    host keeps its own duplicates, which the test reads)."""
    data, ancillary, _flags, _address = sock.recvmsg(command_host.MAX_MESSAGE_BYTES, socket.CMSG_SPACE(16))
    for level, kind, fds in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for index in range(0, len(fds) - len(fds) % 4, 4):
                os.close(int.from_bytes(fds[index : index + 4], sys.byteorder))
    return json.loads(data)


def test_the_replacement_shell_is_started_after_the_calls_exit_is_reported(tmp_path):
    """Through the host's own methods, with real shells: the answer to a spawn starts no
    idle shell (started at once, its start came between a short command's exit and the
    report of it); the exit's report makes the refill due, and the refill starts the shell
    the next call takes. A call that runs on gets its replacement REFILL_AFTER_S after the
    answer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    host = command_host.Host(ours)

    def spawn(call_id: str, command: str) -> command_host.Hosted:
        (tmp_path / call_id).mkdir()
        spec = spec_for(command, tmp_path)
        request = {"op": "spawn", "id": call_id, "dir": str(tmp_path / call_id), "idle_shells": 1, "spec": spec.to_json()}
        host._spawn(call_id, request)
        assert receive_from_host(theirs)["op"] == "spawned"
        return host.commands[call_id]

    try:
        first = spawn("c1", "true")
        assert host.pool.idle == []
        assert 0 < host._refill_wait() <= command_host.REFILL_AFTER_S  # it may still run
        os.waitid(os.P_PID, first.pid, os.WEXITED | os.WNOWAIT)  # `true` has exited
        host._reap(first)
        assert receive_from_host(theirs) == {"op": "exited", "id": "c1", "status": 0}
        assert host.pool.idle == []  # reported before the replacement's start
        assert host._refill_wait() == 0.0
        host._refill()
        [waiting] = host.pool.idle
        assert host._refill_wait() is None

        second = spawn("c2", "sleep 30")
        assert second.pid == waiting.pid  # the call took the idle shell
        assert host.pool.idle == []
        assert 0 < host._refill_wait() <= command_host.REFILL_AFTER_S
        assert host.pending_refill is not None
        host.pending_refill = host.pending_refill._replace(  # REFILL_AFTER_S later, still running
            since=host.pending_refill.since - command_host.REFILL_AFTER_S
        )
        assert host._refill_wait() == 0.0
        host._refill()
        assert len(host.pool.idle) == 1 and host.pool.idle[0].pid != second.pid
    finally:
        for command in host.commands.values():
            if command.status is None:
                os.killpg(command.pid, signal.SIGKILL)
                os.waitpid(command.pid, 0)
        host.pool.clear()
        ours.close()
        theirs.close()


def open_for_writing_as(user: pwd.struct_passwd, path: str) -> int:
    """errno of opening `path` for writing as `user` in a process of its own (0: it opened,
    and `echo injected` was written, NUL-terminated as a command)."""
    attacker = subprocess.run(
        [
            "/usr/bin/python3",  # the venv's may be out of the command user's reach
            "-I",
            "-c",
            "import sys\n"
            "try:\n"
            f"    f = open({path!r}, 'w')\n"
            "    f.write('echo injected\\0')\n"
            "    f.close()\n"
            "except OSError as e:\n"
            "    print(e.errno)\n"
            "else:\n"
            "    print(0)\n",
        ],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        cwd="/",
    )
    assert attacker.returncode == 0, attacker.stderr
    return int(attacker.stdout)


def stub_channel(pid: int) -> int:
    """The descriptor an idle shell's stub reads its command from (`<&N`), once its exec has
    completed: the host's spawn returns as the exec replaces the memory, and until the exec
    is done the new cmdline reads empty."""
    deadline = time.monotonic() + DEADLINE_S
    while not (found := re.search(r"<&(\d+)", Path(f"/proc/{pid}/cmdline").read_bytes().decode())):
        assert time.monotonic() < deadline, "the idle shell's exec did not complete"
        time.sleep(0.001)
    return int(found.group(1))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a command user")
@pytest.mark.parametrize("who", ["command-user", "daemon-user"])
def test_another_process_of_the_command_user_cannot_write_a_command_into_an_idle_shell(tmp_path, monkeypatch, who):
    """The channel is a socket: /proc/PID/fd/N of a socket cannot be opened (ENXIO), by the
    command user nor by root, so no process can inject a command into the next call's shell
    (a pipe could be opened so by its owner: without [exec] user, the daemon's own user, whose
    processes the commands are). With a command user, the shell's output pipes, made by the
    host (root, 0600), cannot be opened either (EACCES)."""
    attacker = pwd.getpwnam("nobody" if who == "command-user" else "root")
    os.chmod(tmp_path, 0o755)
    ids = {"uid": attacker.pw_uid, "gid": attacker.pw_gid, "groups": ()} if who == "command-user" else {}
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            pool.refill(spec_for("true", tmp_path, **ids))
            shell = pool.idle[0]
            # The shell's end: the number its stub reads from (`<&N`).
            channel = stub_channel(shell.pid)
            assert os.readlink(f"/proc/{shell.pid}/fd/{channel}").startswith("socket:")
            channel_errno = open_for_writing_as(attacker, f"/proc/{shell.pid}/fd/{channel}")
            stdout_errno = open_for_writing_as(attacker, f"/proc/{shell.pid}/fd/1")
            taken = pool.take(spec_for("echo ran", tmp_path, **ids))
            assert taken is not None and taken.pid == shell.pid
            stdout, stderr, code = collect(shell.pid, shell.outputs)
        finally:
            pool.clear()
    assert channel_errno == errno.ENXIO
    if who == "command-user":
        assert stdout_errno == errno.EACCES
        assert (stdout, stderr, code) == ("ran\n", "", 0)
    else:
        # root opened the pipe: what it wrote is output, never a command.
        assert stdout_errno == 0
        assert (stdout, stderr, code) == ("echo injected\0ran\n", "", 0)


def test_specs_that_never_run_pooled(tmp_path):
    assert command_host.pool_key(spec_for("true", tmp_path)) is not None
    long = "true " + "x" * command_host.POOL_MAX_COMMAND_BYTES
    assert command_host.pool_key(spec_for(long, tmp_path)) is None
    assert command_host.pool_key(spec_for("true", tmp_path)._replace(argv=("/bin/bash", "-l", "-c", "true"))) is None
    assert command_host.pool_key(spec_for("true", tmp_path)._replace(argv=("/bin/sh", "-c", "true"))) is None
    for name in ("BASH_ENV", "SHELLOPTS", "BASHOPTS", "BASH_FUNC_ls%%", command_host.POOL_VARIABLE, "__sst_underscore"):
        assert command_host.pool_key(spec_for("true", tmp_path, env={**ENV, name: "x"})) is None, name
    # The command, the cgroups and the takeover's settings are not part of the key.
    a = spec_for("true", tmp_path)
    b = spec_for("false", tmp_path)._replace(cgroup="/sys/fs/cgroup/x", timeout_s=3.0, kill_grace_s=9.0)
    assert command_host.pool_key(a) == command_host.pool_key(b)
    assert command_host.pool_key(a) != command_host.pool_key(a._replace(env={**ENV, "X": "1"}))


def test_a_shell_of_another_spec_is_killed_and_the_call_spawned_fresh(tmp_path, monkeypatch):
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            pool.refill(spec_for("true", tmp_path))
            stale = pool.idle[0]
            other = spec_for("true", tmp_path, env={**ENV, "X": "1"})
            assert pool.take(other) is None
            pool.refill(other)
            assert [s.pid for s in pool.idle] != [stale.pid]
            wait_gone(stale.pid)
        finally:
            pool.clear()


def wait_gone(pid: int) -> None:
    """Until `pid` is dead (a zombie or reaped): a SIGKILL takes effect asynchronously."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"{pid} still runs"
        time.sleep(0.005)


def test_a_dead_or_displaced_shell_is_never_used(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            # Killed while idle (another process of the command user may): not handed out.
            pool.refill(spec_for("true", cwd))
            victim = pool.idle[0]
            os.kill(victim.pid, signal.SIGKILL)
            os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)
            assert pool.take(spec_for("true", cwd)) is None
            # Stopped while idle: a fresh spawn runs where it would hang until the timeout.
            pool.refill(spec_for("true", cwd))
            stopped = pool.idle[0]
            os.kill(stopped.pid, signal.SIGSTOP)
            os.waitid(os.P_PID, stopped.pid, os.WSTOPPED | os.WNOWAIT)
            assert pool.take(spec_for("true", cwd)) is None
            # Its cwd replaced by another directory of the same name: a fresh spawn enters
            # the new one.
            pool.refill(spec_for("true", cwd))
            displaced = pool.idle[0]
            cwd.rmdir()
            cwd.mkdir()
            assert pool.take(spec_for("true", cwd)) is None
            assert not pool.idle
            # Its call's cgroup is gone: not handed out (the fresh spawn reports the cgroup).
            pool.refill(spec_for("true", cwd))
            moved = pool.idle[0]
            assert pool.take(spec_for("true", cwd)._replace(cgroup=str(tmp_path / "no-such-cgroup"))) is None
        finally:
            pool.clear()
    for pid in (victim.pid, stopped.pid, displaced.pid, moved.pid):
        wait_gone(pid)


def test_idle_shells_is_validated_and_reaches_the_host(tmp_path):
    """`[exec] idle_shells` (docs/operations.md, "Pre-started shells"): 1 unless set, an
    integer from 0 to MAX_IDLE_SHELLS, and what the daemon's link sends with each spawn."""
    from test_config import REQUIRED_ENV, problems_of

    from sandbox_supervisor.daemon.config import ConfigError, load_config
    from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost

    assert load_config(None, env=REQUIRED_ENV).exec.idle_shells == 1
    assert load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__IDLE_SHELLS": "0"}).exec.idle_shells == 0
    for bad in ("-1", str(command_host.MAX_IDLE_SHELLS + 1), "many"):
        with pytest.raises(ConfigError) as excinfo:
            load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__IDLE_SHELLS": bad})
        assert "exec.idle_shells" in problems_of(excinfo)
    assert CommandHost(3).idle_shells == 3
    # The host sizes its pool from the request, bounded; 0 kills what it kept.
    pool = command_host.ShellPool(Spawner())
    try:
        pool.resize(command_host.MAX_IDLE_SHELLS + 5)
        assert pool.size == command_host.MAX_IDLE_SHELLS
        pool.resize(2)
        pool.refill(spec_for("true", tmp_path))
        assert len(pool.idle) == 2
        pids = [s.pid for s in pool.idle]
        pool.resize(0)
        assert not pool.idle and pool.take(spec_for("true", tmp_path)) is None
    finally:
        pool.clear()
    for pid in pids:
        wait_gone(pid)


def idle_children(host_pid: int) -> list[int]:
    """The host's children that are idle shells (their cmdline is the stub)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == host_pid and stat[0] != "Z" and command_host.POOL_VARIABLE.encode() in cmdline:
            found.append(int(entry.name))
    return found


async def run_through(host, call_id: str, directory: Path, spec: HolderSpec) -> tuple[bytes, int]:
    process = await host.spawn(call_id, directory, spec)
    assert process.stdout is not None
    out = b""
    with trio.fail_after(DEADLINE_S):
        while chunk := await process.stdout.receive_some(65536):
            out += chunk
        code = await process.wait()
    host.done(call_id)
    host.flush()
    return out, code


@pytest.mark.parametrize("idle_shells", [1, 0])
async def test_the_host_runs_the_next_call_in_a_pooled_shell_and_kills_idle_ones_when_the_daemon_goes(tmp_path, idle_shells):
    """Through the real host: the first call is spawned fresh and the host starts an idle
    shell after answering; the next call with the same spec runs in it (its -c string is the
    stub's). Closing the link (a daemon's stop or death) kills the idle shells. With 0, no
    shell is kept and every call is fresh."""
    from sandbox_supervisor.daemon.runtime.command_host_link import CommandHost

    host = CommandHost(idle_shells)
    spec = spec_for("echo $BASH_EXECUTION_STRING", tmp_path)
    try:
        first, code = await run_through(host, "c1", tmp_path / "c1", spec)
        assert (first, code) == (b"echo $BASH_EXECUTION_STRING\n", 0)
        assert host._process is not None
        host_pid = host._process.pid
        with trio.fail_after(DEADLINE_S):
            while len(idle_children(host_pid)) != idle_shells:
                await trio.sleep(0.01)
        waiting = idle_children(host_pid)
        second, code = await run_through(host, "c2", tmp_path / "c2", spec)
        assert code == 0
        if idle_shells:
            assert second.startswith(b"printf -v " + command_host.POOL_UNDERSCORE_VARIABLE.encode())
        else:
            assert second == first
        with trio.fail_after(DEADLINE_S):
            while len(idle_children(host_pid)) != idle_shells:
                await trio.sleep(0.01)
        waiting = idle_children(host_pid)
    finally:
        await host.aclose()
    for pid in waiting:
        wait_gone(pid)
    with trio.fail_after(DEADLINE_S):
        await host._process.wait()


def test_a_command_bash_would_get_as_bytes_arrives_as_the_same_bytes(tmp_path, monkeypatch):
    """Multibyte text, a byte that is not UTF-8 (surrogateescape, as Popen encodes argv),
    quotes, backslashes, newlines and leading and trailing blanks reach the shell unchanged;
    a command Popen could not encode is never pooled (its fresh spawn reports it)."""
    command = "printf '%s|' \"$(printf 'é\\\\n')\" '\udcff' \\\\ \"a\nb\"  \t"
    with fast_only(monkeypatch) as spawner:
        pool = command_host.ShellPool(spawner, 1)
        try:
            _, old = fresh(spawner, spec_for(command, tmp_path))
            _, new = pooled(pool, spec_for(command, tmp_path))
        finally:
            pool.clear()
    assert new == old and old[2] == 0
    assert command_host.pool_key(spec_for("echo \ud800", tmp_path)) is None
