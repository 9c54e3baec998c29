"""Privilege separation: `[exec] user` runs commands as their own unprivileged user, who can
neither touch the daemon's state nor signal it (docs/operations.md, "Privilege separation").

The wire tests need root (CI runs as root) and use `nobody`, which every Debian system has,
so the machine is not changed. The daemon's root directory is made outside pytest's
tmp_path, whose root-only parent the command user could not enter.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from sandbox_supervisor.daemon import app
from sandbox_supervisor.daemon.app import StartupError, command_identity
from sandbox_supervisor.daemon.config import ConfigError, ExecConfig, load_config
from sandbox_supervisor.daemon.runtime.identity import (
    CommandIdentity,
    account_environment,
    resolve_identity,
    unsafe_paths,
)
from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ
from sandbox_supervisor.daemon.runtime.shell import build_environment
from sandbox_supervisor.daemon.state.store import DB_FILENAME
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.client import http_request
from sandbox_supervisor.testing.daemon import (
    DaemonExitedEarly,
    DaemonLayout,
    in_process_daemon,
    make_layout,
    running_daemon,
)

from conftest import FAST_WEBSOCKET
from test_file_tools_wire import patch_params

AGENT_USER = "nobody"  # uid 65534 on Debian; present on every machine this project runs on

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching the command user needs root (CI runs as root)"
)


def agent() -> pwd.struct_passwd:
    return pwd.getpwnam(AGENT_USER)


# --- the pure check ----------------------------------------------------------------------

USER = CommandIdentity(uid=1000, gid=1000, groups=(27,))


def st(mode: int, uid: int = 0, gid: int = 0) -> SimpleNamespace:
    return SimpleNamespace(st_mode=mode, st_uid=uid, st_gid=gid)


DIR = stat.S_IFDIR


@pytest.mark.parametrize(
    ("info", "unsafe"),
    [
        (st(DIR | 0o700), False),  # root's private directory
        (st(DIR | 0o755), False),
        (st(DIR | 0o500, uid=1000), True),  # the user owns it: it can chmod itself in
        (st(DIR | 0o770, gid=1000), True),  # the user's primary group may write
        (st(DIR | 0o770, gid=27), True),  # a supplementary group may write
        (st(DIR | 0o750, gid=27), False),  # the group may only read
        (st(DIR | 0o777, gid=5), True),  # world-writable
        (st(DIR | 0o775, gid=5), False),  # another group's
    ],
)
def test_a_path_is_unsafe_when_the_user_can_write_it(info: SimpleNamespace, unsafe: bool) -> None:
    assert bool(unsafe_paths([("/x", info)], USER)) is unsafe


def test_every_ancestor_counts_but_a_sticky_one_only_guards_others_entries() -> None:
    root, state = ("/", st(DIR | 0o755)), ("/tmp/s", st(DIR | 0o700))
    # /tmp (1777): the user may not rename root's entry in it.
    assert unsafe_paths([root, ("/tmp", st(DIR | 0o1777)), state], USER) == []
    # ...but it may rename its own, and a non-sticky world-writable parent lets it rename any.
    own = ("/tmp/s", st(DIR | 0o700, uid=1000))
    assert len(unsafe_paths([root, ("/tmp", st(DIR | 0o1777)), own], USER)) == 2
    problems = unsafe_paths([root, ("/srv", st(DIR | 0o777)), state], USER)
    assert problems == ["/srv is writable by the command user (uid 1000)"]


# --- configuration -----------------------------------------------------------------------

REQUIRED = {"SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "i", "SANDBOX_SUPERVISOR_AUTHORITY__JWKS_FILE": "/k"}


def test_exec_user_is_resolved_at_load_and_unknown_names_are_configuration_errors() -> None:
    config = load_config(None, env={**REQUIRED, "SANDBOX_SUPERVISOR_EXEC__USER": AGENT_USER})
    who = config.exec.command_identity()
    assert who is not None and (who.uid, who.gid, who.groups) == (agent().pw_uid, agent().pw_gid, ())
    assert load_config(None, env=REQUIRED).exec.command_identity() is None  # default: unset
    numeric = ExecConfig(user=agent().pw_uid, group=0, supplementary_groups=["nogroup", 0])
    assert numeric.command_identity() == CommandIdentity(
        uid=agent().pw_uid, gid=0, groups=(65534, 0), name="nobody", home=agent().pw_dir, shell=agent().pw_shell
    )
    for bad, message in [
        ({"user": "sbx-no-such-user"}, "unknown user 'sbx-no-such-user'"),
        ({"user": AGENT_USER, "group": "sbx-no-such-group"}, "unknown group 'sbx-no-such-group'"),
        ({"user": AGENT_USER, "supplementary_groups": ["sbx-no-such-group"]}, "unknown group"),
        ({"user": "root"}, "must not be root"),
        ({"group": "nogroup"}, "need user to be set"),
        ({"user": 4_000_000}, "set [exec] group too"),  # a bare uid without passwd entry
    ]:
        with pytest.raises(ConfigError) as excinfo:
            load_config(None, env=REQUIRED, overrides={f"exec.{k}": v for k, v in bad.items()})
        assert message in str(excinfo.value), excinfo.value


def test_home_and_user_come_from_passwd_unless_agent_env_or_the_call_sets_them() -> None:
    who = account_environment(resolve_identity(AGENT_USER, None, []))
    base = {"PATH": "/bin", "HOME": "/home/user"}
    env = build_environment(base, {}, None, who)
    assert (env["HOME"], env["USER"], env["LOGNAME"], env["SHELL"]) == (
        agent().pw_dir, "nobody", "nobody", agent().pw_shell
    )
    assert build_environment(base, {"HOME": "/w"}, {"USER": "u"}, who)["HOME"] == "/w"
    assert build_environment(base, {"HOME": "/w"}, {"USER": "u"}, who)["USER"] == "u"
    assert build_environment(base, {}, None, {}) == base  # no passwd entry: base_env's


# --- over the wire ------------------------------------------------------------------------


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A root-owned 0755 directory the command user can enter but not write."""
    root = Path(tempfile.mkdtemp(prefix="sbx-privsep-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def separated_layout(root: Path, authority: LoopbackAuthority, **exec_settings: object) -> DaemonLayout:
    layout = make_layout(
        root / "d", authority=authority, websocket=dict(FAST_WEBSOCKET), exec={"user": AGENT_USER, **exec_settings}
    )
    os.chmod(layout.root, 0o755)
    os.chown(layout.workspace, agent().pw_uid, agent().pw_gid)  # the agent's own workspace
    return layout


async def run(session, command: str, key: str) -> tuple[int, str, str]:
    result = await session.call_and_wait("execute_shell_command", {"command": command}, idempotency_key=key)
    assert result["ok"] is True, result
    body = result["result"]
    return body["exit_code"], body["stdout"]["head"], body["stderr"]["head"]


@needs_root
async def test_commands_run_as_the_user_and_cannot_touch_the_daemon(open_root, authority) -> None:
    layout = separated_layout(open_root, authority)
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            code, out, _ = await run(session, "id -u; id -g; id -G", "id")
            assert out.split() == [str(agent().pw_uid), str(agent().pw_gid), str(agent().pw_gid)]
            # The OOM wrapper runs as the user too, and raising one's own score needs no privilege.
            _, out, _ = await run(session, "cat /proc/self/oom_score_adj", "oom")
            assert out.strip() == str(COMMAND_OOM_SCORE_ADJ)
            db = layout.state_dir / DB_FILENAME
            code, _, err = await run(session, f"cat {db} > /dev/null", "read-db")
            assert code != 0 and "Permission denied" in err
            code, _, err = await run(session, f": >> {db}", "write-db")
            assert code != 0
            code, _, err = await run(session, f"kill -0 {os.getpid()}", "signal")
            assert code != 0 and "not permitted" in err
            _, out, _ = await run(session, 'echo "$HOME $USER $LOGNAME"', "env")
            assert out.split() == [agent().pw_dir, "nobody", "nobody"]
            created = await session.call_and_wait(
                "apply_file_patch", patch_params("new/dir/f.txt", None, "x\n"), idempotency_key="p1"
            )
            assert created["ok"] is True, created
            for path in (layout.workspace / "new", layout.workspace / "new/dir", layout.workspace / "new/dir/f.txt"):
                info = os.stat(path)
                assert (info.st_uid, info.st_gid) == (agent().pw_uid, agent().pw_gid), path
            # ...so the agent can go on editing what the control plane patched.
            code, _, err = await run(session, "echo y >> new/dir/f.txt && mkdir new/dir/more", "edit")
            assert code == 0, err
            # A replaced file keeps its owner and mode.
            theirs = layout.workspace / "theirs.txt"
            theirs.write_text("a\n")
            os.chown(theirs, 0, 0)
            os.chmod(theirs, 0o640)
            replaced = await session.call_and_wait(
                "apply_file_patch", patch_params("theirs.txt", "a\n", "b\n"), idempotency_key="p2"
            )
            assert replaced["ok"] is True, replaced
            info = os.stat(theirs)
            assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 0, 0o640)
        health = await http_request(daemon.tcp, "GET", "/healthz")
        assert health.json()["privilegeSeparation"] is True


@needs_root
async def test_without_exec_user_commands_run_as_the_daemon(open_root, authority) -> None:
    layout = make_layout(open_root / "d", authority=authority, websocket=dict(FAST_WEBSOCKET))
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            _, out, _ = await run(session, "id -u", "id")
            assert out.strip() == str(os.geteuid())
        health = await http_request(daemon.tcp, "GET", "/healthz")
        assert health.json()["privilegeSeparation"] is False


async def test_a_daemon_that_cannot_switch_users_runs_as_itself_and_says_so(
    open_root, authority, monkeypatch, log_lines
) -> None:
    monkeypatch.setattr(app, "can_switch_user", lambda: False)
    layout = separated_layout(open_root, authority) if os.geteuid() == 0 else make_layout(
        open_root / "d", authority=authority, websocket=dict(FAST_WEBSOCKET), exec={"user": AGENT_USER}
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            _, out, _ = await run(session, "id -u", "id")
            assert out.strip() == str(os.geteuid())
        health = await http_request(daemon.tcp, "GET", "/healthz")
        assert health.json()["privilegeSeparation"] is False
    warnings = [line for line in log_lines() if line.get("event") == "supervisor.privilege_separation_unavailable"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning"


@needs_root
@pytest.mark.parametrize("where", ["state_dir", "parent", "database", "socket_dir", "jwks", "symlink_target"])
def test_start_is_refused_when_the_user_could_write_the_state(open_root, authority, where) -> None:
    layout = separated_layout(open_root, authority)
    nogroup = agent().pw_gid
    layout.state_dir.mkdir(mode=0o700)
    (layout.state_dir / DB_FILENAME).write_bytes(b"")
    if where == "state_dir":
        target = layout.state_dir
        os.chown(target, 0, nogroup)
        os.chmod(target, 0o770)
    elif where == "parent":
        target = layout.root
        os.chmod(target, 0o777)
    elif where == "database":
        target = layout.state_dir / DB_FILENAME
        os.chown(target, agent().pw_uid, 0)
    elif where == "jwks":
        # The trust anchor: a user who could write the key set could add its own key.
        target = layout.jwks_file
        os.chown(target, agent().pw_uid, 0)
    elif where == "symlink_target":
        # The state dir named through a symlink whose target sits in a directory the user owns.
        home = open_root / "agent-home"
        home.mkdir()
        os.chown(home, agent().pw_uid, 0)
        real = home / "state"
        layout.state_dir.rename(real)
        layout.state_dir.symlink_to(real)
        target = home
    else:
        sockets = open_root / "sockets"
        sockets.mkdir()
        os.chown(sockets, agent().pw_uid, 0)
        layout.settings["listen"] = {"unix": [str(sockets / "control.sock")]}
        target = sockets
    with pytest.raises(StartupError, match=f"{target} is writable by the command user"):
        command_identity(layout.config())


@needs_root
def test_a_root_daemon_without_exec_user_says_commands_run_as_root(open_root, authority, log_lines) -> None:
    layout = separated_layout(open_root, authority)
    layout.settings["exec"] = {}
    assert command_identity(layout.config()) is None
    warnings = [line for line in log_lines() if line.get("event") == "supervisor.commands_run_as_root"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning"


@needs_root
async def test_serve_exits_2_naming_a_state_dir_the_user_can_write(open_root, authority) -> None:
    layout = separated_layout(open_root, authority)
    layout.state_dir.mkdir(mode=0o777)
    os.chmod(layout.state_dir, 0o777)
    with pytest.raises(DaemonExitedEarly) as exited:
        async with running_daemon(layout):
            raise AssertionError("the daemon must not start")
    assert exited.value.returncode == 2
    assert f"{layout.state_dir} is writable by the command user" in exited.value.log
    # Made root's own again, the same configuration starts.
    os.chmod(layout.state_dir, 0o700)
    async with running_daemon(layout) as process:
        with trio.fail_after(10):
            health = await http_request(process.running.tcp, "GET", "/healthz")
        assert health.json()["privilegeSeparation"] is True


@needs_root
def test_a_state_dir_not_made_yet_is_judged_by_the_directory_it_will_be_made_in(open_root, authority) -> None:
    layout = separated_layout(open_root, authority)
    assert not layout.state_dir.exists()
    assert command_identity(layout.config()) is not None  # root's 0755 parent: fine
    os.chmod(layout.root, 0o777)
    with pytest.raises(StartupError, match=f"{layout.root} is writable by the command user"):
        command_identity(layout.config())
