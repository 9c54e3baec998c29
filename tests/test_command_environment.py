"""The environment a command runs in (docs/protocol.md §7.4.1): the default PATH, the command
user's HOME/USER/LOGNAME/SHELL, TERM only with a terminal, and `[exec] login_shell` — never
for a call whose assertion has allowed_commands, since the profile files are the agent's.

The wire tests need root (CI runs as root) to run commands as a real unprivileged user:
`nobody`, or a uid without a passwd entry whose HOME the operator's base_env gives, so a
test can put a ~/.profile there without changing the machine's accounts.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.config import SYSTEM_PATH
from sandbox_supervisor.daemon.runtime.identity import account_environment
from sandbox_supervisor.daemon.runtime.shell import (
    DEFAULT_TERM,
    build_environment,
    default_path,
    shell_argv,
    terminal_type,
    uses_login_shell,
)
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

from conftest import FAST_WEBSOCKET
from test_privsep import AGENT_USER, agent, needs_root, open_root, run, separated_layout

__all__ = ["open_root"]  # a fixture, used by name

# A uid no account has: commands run as it with the operator's base_env HOME.
BARE_UID = 3_917_411
PROFILE_MARKER = "login-marker"
# ~/.profile of the login test: leaves a file behind and exports a variable.
PROFILE = f'echo ran >> "$HOME/{PROFILE_MARKER}"\nexport PROFILE_RAN=yes\n'


# --- the pure parts ----------------------------------------------------------------------


def test_the_default_path_puts_the_users_local_bin_before_the_system_directories() -> None:
    assert SYSTEM_PATH.split(":") == [
        "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"
    ]
    assert default_path("/home/u") == f"/home/u/.local/bin:{SYSTEM_PATH}"
    assert default_path("/home/u/") == f"/home/u/.local/bin:{SYSTEM_PATH}"
    assert default_path(None) == default_path("") == SYSTEM_PATH


def test_the_default_path_is_only_a_default_each_layer_still_wins() -> None:
    account = {"HOME": "/home/u", "USER": "u"}
    assert build_environment({}, {}, None, account)["PATH"] == default_path("/home/u")
    assert build_environment({"PATH": "/op"}, {}, None, account)["PATH"] == "/op"
    assert build_environment({"PATH": "/op"}, {"PATH": "/agent"}, None, account)["PATH"] == "/agent"
    assert build_environment({"PATH": "/op"}, {"PATH": "/agent"}, {"PATH": "/call"}, account)["PATH"] == "/call"
    # ~/.local/bin is the trusted home's (the passwd entry's, else base_env's), not the caller's.
    assert build_environment({}, {"HOME": "/x"}, {"HOME": "/y"}, account)["PATH"] == default_path("/home/u")
    assert build_environment({"HOME": "/op"}, {}, None, {})["PATH"] == default_path("/op")


def test_term_is_set_only_for_a_terminal() -> None:
    assert DEFAULT_TERM == "xterm-256color"
    assert "TERM" not in build_environment({}, {}, None, {})
    assert build_environment({}, {}, {"TERM": "dumb"}, {})["TERM"] == "dumb"  # the env's own
    assert build_environment({}, {}, None, {}, terminal=True)["TERM"] == DEFAULT_TERM
    assert build_environment({}, {}, None, {}, terminal=True, term="vt100")["TERM"] == "vt100"
    assert build_environment({}, {"TERM": "screen"}, None, {}, terminal=True)["TERM"] == "screen"
    assert terminal_type("vt100", {"TERM": "screen"}) == "vt100"
    assert terminal_type(None, {}) == DEFAULT_TERM


def test_a_login_shell_is_asked_for_by_the_option_and_never_for_a_guarded_call() -> None:
    assert shell_argv("/bin/bash", "ls", login=False) == ["/bin/bash", "-c", "ls"]
    assert shell_argv("/bin/bash", "ls", login=True) == ["/bin/bash", "-l", "-c", "ls"]
    assert uses_login_shell(True, None) is True
    assert uses_login_shell(True, ("ls",)) is False
    assert uses_login_shell(True, ()) is False
    assert uses_login_shell(False, None) is False


def test_without_exec_user_the_account_is_the_daemons_own() -> None:
    me = pwd.getpwuid(os.geteuid())
    assert account_environment(None) == {
        "HOME": me.pw_dir, "USER": me.pw_name, "LOGNAME": me.pw_name, "SHELL": me.pw_shell
    }


# --- what a command sees -----------------------------------------------------------------

# TERM through printenv: bash gives itself an unexported TERM=dumb when none is passed.
SHOW = 'id -un; echo "$PATH"; echo "$HOME"; echo "$USER $LOGNAME $SHELL"; printenv TERM || echo no-term'


@needs_root
async def test_a_command_of_the_user_sees_its_account_and_the_default_path(open_root, authority) -> None:
    # base_env without PATH (an operator's LANG only) still gets the default.
    layout = separated_layout(open_root, authority, base_env={"LANG": "C.UTF-8"})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            code, out, err = await run(session, SHOW, "show")
            assert code == 0, err
            home = agent().pw_dir
            assert out.splitlines() == [
                AGENT_USER,
                f"{home}/.local/bin:{SYSTEM_PATH}",
                home,
                f"{AGENT_USER} {AGENT_USER} {agent().pw_shell}",
                "no-term",  # pipes, not a terminal
            ]
            # The caller's PATH still wins over the default.
            result = await session.call_and_wait(
                "execute_shell_command", {"command": 'echo "$PATH"', "env": {"PATH": "/opt/x:/bin"}},
                idempotency_key="path",
            )
            assert result["result"]["stdout"]["head"] == "/opt/x:/bin\n", result


@needs_root
async def test_without_exec_user_a_command_sees_the_daemons_account(open_root, authority) -> None:
    me = pwd.getpwuid(os.geteuid())
    layout = make_layout(open_root / "d", authority=authority, websocket=dict(FAST_WEBSOCKET))
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            code, out, err = await run(session, SHOW, "show")
            assert code == 0, err
            assert out.splitlines() == [
                me.pw_name,
                f"{me.pw_dir}/.local/bin:{SYSTEM_PATH}",
                me.pw_dir,
                f"{me.pw_name} {me.pw_name} {me.pw_shell}",
                "no-term",
            ]


def bare_uid_layout(root: Path, authority: LoopbackAuthority, home: Path, **exec_settings: object):
    layout = make_layout(
        root / "d",
        authority=authority,
        websocket=dict(FAST_WEBSOCKET),
        exec={"user": BARE_UID, "group": "nogroup", "base_env": {"HOME": str(home)}, **exec_settings},
    )
    os.chmod(layout.root, 0o755)
    os.chown(layout.workspace, BARE_UID, agent().pw_gid)
    return layout


@needs_root
@pytest.mark.parametrize("login_shell", [True, False])
async def test_a_login_shell_reads_the_profile_except_for_a_guarded_call(
    open_root, authority, login_shell
) -> None:
    with pytest.raises(KeyError):
        pwd.getpwuid(BARE_UID)  # really an account-less uid
    home = open_root / "home"
    home.mkdir(mode=0o755)
    (home / ".profile").write_text(PROFILE)
    for path in (home, home / ".profile"):
        os.chown(path, BARE_UID, agent().pw_gid)  # the agent's own, as in a real home
    marker = home / PROFILE_MARKER
    layout = bare_uid_layout(open_root, authority, home, login_shell=login_shell)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        # Guarded first: were the profile read here, the marker would already exist below.
        async with client.connect(claim_overrides={"allowed_commands": ["echo"]}) as session:
            await session.bootstrap(cwd=str(layout.workspace))
            code, out, err = await run(session, 'echo "${PROFILE_RAN-no}"', "guarded")
            assert (code, out, err) == (0, "no\n", "")
            assert not marker.exists()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            code, out, err = await run(session, 'echo "${PROFILE_RAN-no}"; id -u', "unguarded")
            assert code == 0, err
            ran = "yes" if login_shell else "no"
            assert out.splitlines() == [ran, str(BARE_UID)]
            assert marker.exists() is login_shell
