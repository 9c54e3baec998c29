"""The allowed_commands guard covers the environment and arithmetic contexts (§7.4.2).

With allowed_commands set, a call may not set environment names that make bash or a common
tool run code the command line does not show (BASH_ENV, GIT_CONFIG_*, PS4 …), and a line
may not use an arithmetic context, which runs command substitutions written in single
quotes (`[[ 'a[$(cmd)]' -eq 0 ]]`). Without allowed_commands nothing changes.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.protocol.errors import FORBIDDEN
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.guard import (
    ENVIRONMENT_DENY_POLICY,
    GuardRefusal,
    check_allowed,
    check_environment,
    denied_environment_name,
    simple_command_names,
)
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

DENIED_NAMES = [
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PS1", "PROMPT_COMMAND", "BASH_XTRACEFD",
    "BASH_FUNC_ls%%", "BASH_FUNC_ls", "ls%%", "A-B", "",
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH",
    "GIT_CONFIG", "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0", "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_GLOBAL", "GIT_SSH_COMMAND", "GIT_PROXY_COMMAND", "GIT_SSH", "GIT_EXTERNAL_DIFF",
    "GIT_ASKPASS", "GIT_EXEC_PATH", "GIT_PAGER", "GIT_EDITOR", "GIT_DIR", "GIT_TEMPLATE_DIR",
    "SSH_ASKPASS", "SUDO_ASKPASS", "RUSTC_WRAPPER", "SYSTEMD_PAGER",
    "PAGER", "MANPAGER", "EDITOR", "VISUAL", "LESSOPEN",
    "PERL5OPT", "PERL5LIB", "PERLLIB", "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME", "PYTHONBREAKPOINT",
    "PYTHONWARNINGS", "NODE_OPTIONS", "NODE_PATH", "RUBYOPT", "RUBYLIB", "JAVA_TOOL_OPTIONS",
    "NPM_CONFIG_SCRIPT_SHELL", "npm_config_node_options",
    "IFS", "PATH", "CDPATH", "GLOBIGNORE", "EXECIGNORE", "TMOUT", "SHELL", "HOME", "XDG_CONFIG_HOME",
    "MAKEFLAGS",
]  # fmt: skip
ALLOWED_NAMES = [
    "CI", "LANG", "LC_ALL", "TERM", "TZ", "FOO", "MY_PATH_HINT", "DEBUG", "RUST_LOG", "TMPDIR",
    "GIT_AUTHOR_NAME", "GIT_COMMITTER_EMAIL", "GIT_TERMINAL_PROMPT",
    "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "NODE_ENV",
]  # fmt: skip


@pytest.mark.parametrize("name", DENIED_NAMES)
def test_a_denied_name_has_a_reason(name: str) -> None:
    assert denied_environment_name(name)


@pytest.mark.parametrize("name", ALLOWED_NAMES)
def test_a_harmless_name_is_allowed(name: str) -> None:
    assert denied_environment_name(name) is None


def test_every_family_of_the_policy_says_why() -> None:
    for rule in ENVIRONMENT_DENY_POLICY:
        assert rule.names and rule.reason
        assert all(name == name.upper() for name in rule.names)


def test_a_refused_variable_is_forbidden_and_named() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_environment({"CI": "1", "BASH_ENV": "x"}, "env")
    assert failed.value.code == FORBIDDEN
    assert "'BASH_ENV'" in failed.value.message and "(env)" in failed.value.message
    assert failed.value.to_error() == {
        "code": FORBIDDEN,
        "message": failed.value.message,
        "command": None,
        "variable": "BASH_ENV",
    }
    check_environment({"CI": "1", "GIT_AUTHOR_NAME": "a"}, "agent.env")


# The line itself can set the same variables: assignments before a command, env's NAME=value
# words, export and readonly, and builtins that assign a named variable.
LINE_ASSIGNMENTS_REFUSED = [
    ("PATH=/tmp/evil ls", "PATH"),
    ("PATH+=:/tmp/evil ls", "PATH"),
    ("GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=core.fsmonitor GIT_CONFIG_VALUE_0='touch m' git status", "GIT_CONFIG_COUNT"),
    ("BASH_ENV=/tmp/x", "BASH_ENV"),
    ("X=1 PS4='$(touch m)' ls", "PS4"),
    ("env LD_PRELOAD=/tmp/x.so ls", "LD_PRELOAD"),
    ("env -i 'BASH_FUNC_ls%%=() { touch m; }' ls", "BASH_FUNC_ls%%"),
    ("export PATH=/tmp/evil; ls", "PATH"),
    ("readonly IFS", "IFS"),
    ("read -r PATH < f", "PATH"),
    ("printf -v PATH /tmp/evil", "PATH"),
]
LINE_ASSIGNMENTS_ALLOWED = [
    ("CI=1 FOO=bar ls", ["ls"]),
    ("env -u PATH -i A=1 ls", ["ls"]),
    ("export FOO=1", ["export"]),
    ("read -r line < f", ["read"]),
    ("echo PATH=/tmp", ["echo"]),
]


@pytest.mark.parametrize(("command", "variable"), LINE_ASSIGNMENTS_REFUSED)
def test_a_line_that_sets_a_denied_variable_is_refused(command: str, variable: str) -> None:
    with pytest.raises(GuardRefusal) as refused:
        simple_command_names(command)
    assert refused.value.variable == variable


@pytest.mark.parametrize(("command", "names"), LINE_ASSIGNMENTS_ALLOWED)
def test_harmless_assignments_in_the_line_pass(command: str, names: list[str]) -> None:
    assert simple_command_names(command) == names


def test_check_allowed_names_the_variable_of_the_line() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_allowed("PATH=/tmp ls", ["ls"])
    assert failed.value.details == {"command": None, "variable": "PATH"}


# --- arithmetic contexts ---

ARITHMETIC_REFUSED = [
    # [[ … ]] evaluates -eq/-lt/… operands and -v subscripts, so all of it is refused
    ("[[ 'a[$(touch m)]' -eq 0 ]]", "[["),
    ("[[ -v 'a[$(touch m)]' ]]", "[["),
    ("[[ -f x ]] && ls", "[["),
    ("ls && [[ $x == y ]]", "[["),
    # arithmetic commands and builtins
    ("((x = 1))", None),
    ("echo $((1 + 1))", None),
    ("echo $[1 + 1]", None),
    ("let 'x = a[$(touch m)]'", "let"),
    ("declare -i x; x='a[$(touch m)]'", "declare"),
    ("typeset -i x", "typeset"),
    ("local -i x", "local"),
    # array subscripts and substrings in parameter expansions
    ("a=1; echo ${a[x]}", None),
    ('echo "${a[@]}"', None),
    ("echo ${#a[0]}", None),
    ("echo ${s:x}", None),
    ("echo ${s: -1}", None),
    ("echo ${s:1:2}", None),
    ("echo ${x:-${a[1]}}", None),
    ("echo ${!x}", None),
    ("echo ${x@P}", None),
    ("cat <<EOF\n${a[x]}\nEOF", None),
    # builtins that take a variable name evaluate its subscript
    ("read 'a[$(touch m)]' < f", "read"),
    ("printf -v 'a[$(touch m)]' x", "printf"),
    ("printf -v'a[$(touch m)]' x", "printf"),
    ("test -v 'a[$(touch m)]'", "test"),
    ("[ -v 'a[$(touch m)]' ]", "["),
    ("unset 'a[$(touch m)]'", "unset"),
    ("wait -p 'a[$(touch m)]'", "wait"),
]
ARITHMETIC_ALLOWED = [
    ("echo ${HOME:-x} ${x:=1} ${x:?m} ${x:+y} ${#x} ${x%y} ${x/a/b} ${@} ${#}", ["echo"]),
    ("echo '${a[1]}' '$((1))' '[[ x ]]'", ["echo"]),
    ("cat <<'EOF'\n${a[1]} $((1))\nEOF", ["cat"]),
    ("[ -f x ] && test 1 -eq 1", ["[", "test"]),
    ("printf '%s' 'a[1]'", ["printf"]),
    ("read -r line < f", ["read"]),
]


@pytest.mark.parametrize(("command", "name"), ARITHMETIC_REFUSED)
def test_arithmetic_contexts_are_refused(command: str, name: str | None) -> None:
    with pytest.raises(GuardRefusal) as refused:
        simple_command_names(command)
    assert refused.value.command_name == name


@pytest.mark.parametrize(("command", "names"), ARITHMETIC_ALLOWED)
def test_expansions_without_arithmetic_pass(command: str, names: list[str]) -> None:
    assert simple_command_names(command) == names


BASH = shutil.which("bash") or "/bin/bash"


@pytest.mark.parametrize(
    "command",
    ["[[ 'a[$(touch m)]' -eq 0 ]]", "[[ -v 'a[$(touch m)]' ]]", "x='a[$(touch m)]'; s=abc; echo ${s:x}",
     "x='a[$(touch m)]'; a=(1); echo ${a[x]}", "read 'a[$(touch m)]' </dev/null", "x='a[$(touch m)]'; echo ${!x}"],
)  # fmt: skip
def test_each_refused_form_really_runs_code_in_bash(command: str, tmp_path: Path) -> None:
    """The refusals are not paranoia: bash runs the single-quoted substitution."""
    subprocess.run([BASH, "-c", command], cwd=tmp_path, capture_output=True, timeout=10, check=False)
    assert (tmp_path / "m").exists()
    with pytest.raises(GuardRefusal):
        simple_command_names(command)


# --- over the wire: a real daemon, a real bash ---


async def _run(session, command: str, env: dict[str, str]) -> dict:
    call_id = await session.call(
        "execute_shell_command", {"command": command, "env": env}, idempotency_key=f"k-{uuid.uuid4()}"
    )
    return await session.result(call_id, timeout=20)


@pytest.mark.parametrize("restricted", [True, False], ids=["allowed_commands", "unrestricted"])
async def test_bash_env_is_refused_only_when_allowed_commands_is_set(tmp_path, authority, restricted):
    layout = make_layout(tmp_path / "d", authority=authority)
    marker = tmp_path / "marker"
    script = tmp_path / "startup.sh"
    script.write_text(f"touch {marker}\n")
    claims = {"allowed_commands": ["ls"]} if restricted else {}
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect(claim_overrides=claims) as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result = await _run(session, "ls", {"BASH_ENV": str(script)})
            if restricted:
                assert result["ok"] is False
                assert result["error"]["code"] == FORBIDDEN
                assert result["error"]["variable"] == "BASH_ENV"
                # The same line without the variable runs: only the environment was refused.
                plain = await _run(session, "ls", {"CI": "1"})
                assert plain["ok"] is True and plain["result"]["exit_code"] == 0
                assert not marker.exists()
            else:
                assert result["ok"] is True and result["result"]["exit_code"] == 0
                assert marker.exists()  # bash did source BASH_ENV: the test is not vacuous


async def test_agent_env_is_checked_too(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect(claim_overrides={"allowed_commands": ["ls"]}) as session:
            body = {
                "sessionId": client.session_id,
                "agent": {"cwd": str(layout.workspace), "profile": "default", "env": {"PS4": "$(touch x)"}},
                "repositories": [],
            }
            await session.bootstrap(body)
            result = await _run(session, "ls", {})
    assert result["ok"] is False and result["error"]["code"] == FORBIDDEN
    assert result["error"]["variable"] == "PS4" and "agent.env" in result["error"]["message"]


def test_the_documented_policy_is_the_enforced_one() -> None:
    """docs/protocol.md §7.4.2 lists every name, prefix and suffix of the policy."""
    from sandbox_supervisor.daemon.runtime.guard import ENVIRONMENT_ALLOWED_EXCEPTIONS

    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text(encoding="utf-8")
    spelled = {"exact": "`{}`", "prefix": "`{}*`", "suffix": "`*{}`"}
    for rule in ENVIRONMENT_DENY_POLICY:
        for name in rule.names:
            assert spelled[rule.match.value].format(name) in doc, name
    for name in ENVIRONMENT_ALLOWED_EXCEPTIONS:
        assert f"`{name}`" in doc, name
