"""The allowed_commands guard (docs/protocol.md §7.4.2): which programs a command line runs."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.errors import FORBIDDEN
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.guard import GuardRefusal, check_allowed, simple_command_names
from sandbox_supervisor.testing.fuzzing import fuzz_settings

NAMED = [
    # a dollar before a quote or bracket that is not ANSI-C quoting or arithmetic
    ('echo "$\'"', ["echo"]),
    ("echo '$[' '$[x]'", ["echo"]),
    ("echo \\$'x'", ["echo"]),
    ("echo $$'x'", ["echo"]),  # $$ (the pid), then a quoted x
    ("cat <<'EOF'\n$[x]\nEOF", ["cat"]),  # a quoted delimiter: the body is text
    # plain commands, paths, arguments
    ("make test", ["make"]),
    ("/usr/bin/make -C src all", ["make"]),
    ("./node_modules/.bin/jest --ci", ["jest"]),
    ("[ -f setup.py ] && python setup.py test", ["[", "python"]),
    # separators
    ("make build; make test", ["make", "make"]),
    ("pytest -x && git status || echo failed", ["pytest", "git", "echo"]),
    ("ls | grep foo | wc -l", ["ls", "grep", "wc"]),
    ("sleep 1 & sleep 2 &", ["sleep", "sleep"]),
    ("ls|&grep x", ["ls", "grep"]),
    ("make\ngit diff\n\nls", ["make", "git", "ls"]),
    ("make;\nls", ["make", "ls"]),
    # quotes: separators inside them are text
    ('echo "a;b && c | d" ; ls', ["echo", "ls"]),
    ("grep -e 'x|y' -e \"a&b\" file", ["grep"]),
    ("python -c 'import os\nos.remove(\"x\")'\nls", ["python", "ls"]),
    ('"make" test', ["make"]),
    ("'ma'ke test", ["make"]),
    ('echo "${HOME:-x}" $PATH *.py', ["echo"]),
    ("echo '$(rm x)' '`rm x`'", ["echo"]),
    ('echo "\\$(rm x)"', ["echo"]),
    # assignments
    ("FOO=1 BAR='a b' make -j4", ["make"]),
    ('CC="gcc -O2" make', ["make"]),
    ("A=1", []),
    ('"A=1" make', ["A=1"]),
    # wrappers
    ("env -i A=1 B=2 pytest -x", ["pytest"]),
    ("env -u HOME -C /tmp -- ls", ["ls"]),
    ("env -iu HOME ls", ["ls"]),
    ("/usr/bin/env python3 x.py", ["python3"]),
    ("nice -n 5 cargo build", ["cargo"]),
    ("nice -n5 cargo build", ["cargo"]),
    ("nice -10 make", ["make"]),
    ("nice --adjustment=3 make", ["make"]),
    ("time make", ["make"]),
    ("time -p pytest", ["pytest"]),
    ("time -p -- pytest | tee log", ["pytest", "tee"]),
    ("time -- make", ["make"]),
    ("time ! grep -q x f", ["grep"]),
    ("time -f %e make", ["-f"]),  # the bash keyword knows only -p: bash runs "-f"
    ("env time -f %e make", ["make"]),  # /usr/bin/time, with its GNU options
    ("npx jest --watch", ["jest"]),
    ("npx -y -p typescript tsc --noEmit", ["tsc"]),
    ("npx --registry=https://registry.example jest", ["jest"]),
    ("npm exec -- eslint .", ["eslint"]),
    ("npm x eslint", ["eslint"]),
    ("npm install", ["npm"]),
    ("npm test", ["npm"]),
    ("pnpm vitest run", ["vitest"]),
    ("pnpm --filter web exec vitest", ["vitest"]),
    ("pnpm run build", ["build"]),
    ("pnpx prettier --check .", ["prettier"]),
    ("bunx --bun vite", ["vite"]),
    ("yarn jest", ["jest"]),
    ("yarn workspace web run test", ["test"]),
    ("FOO=1 env BAR=2 nice -n 1 npx jest", ["jest"]),
    ("env", ["env"]),
    ("yarn", ["yarn"]),
    # redirections, wherever they stand
    ("make 2>&1 | tee log", ["make", "tee"]),
    ("2>/dev/null make", ["make"]),
    (">out make", ["make"]),
    ("make > out 2> err < in", ["make"]),
    ("make &> log", ["make"]),
    ("make >> log 2>&1", ["make"]),
    ("make 2 >x", ["make"]),
    ("cat <<< 'text'", ["cat"]),
    ("> out", []),
    # comments
    ("ls # a comment; rm -rf /", ["ls"]),
    ("ls # don't\nrm x", ["ls", "rm"]),
    ("# only a comment", []),
    ("make#x; rm y", ["make#x", "rm"]),
    # here-documents: the body is text
    ("cat <<'EOF'\nrm -rf /\nEOF\nls", ["cat", "ls"]),
    ("cat <<EOF > f\nhello ${USER}\nEOF\nmake", ["cat", "make"]),
    ("cat <<-EOF\n\trm x\n\tEOF\nls", ["cat", "ls"]),
    ("cat <<- 'EOF'\n\trm x\n\tEOF\nls", ["cat", "ls"]),
    ("cat << -EOF\nrm x\n-EOF\nls", ["cat", "ls"]),
    ("cat <<EOF # a comment\nrm x\nEOF\nls", ["cat", "ls"]),
    ("cat <<A <<B | wc\nrm\nA\nrm\nB\nls", ["cat", "wc", "ls"]),
    # line continuations
    ("make \\\n  test", ["make"]),
    ("FOO=1 \\\n  make", ["make"]),
    ("ma\\\nke", ["make"]),
    # subshells, groups, negation, compound commands
    ("(cd sub && make) > out", ["cd", "make"]),
    ("{ make; git status; } 2>&1", ["make", "git"]),
    ("! grep -q x f && make", ["grep", "make"]),
    ("if [ -f x ] && [ $y -lt 3 ]; then make; else cargo build; fi", ["[", "[", "make", "cargo"]),
    ("if test -f x; then make; fi", ["test", "make"]),
    ("for f in a b; do pytest $f; done", ["pytest"]),
    ("while read -r l; do echo $l; done < f", ["read", "echo"]),
    # wrappers do not hide what they run
    ("find . -name x -exec rm {} \\;", ["find"]),
]

REFUSED = [
    # ANSI-C quoting: bash escapes a quote inside it where shlex ends the quote, so the rest
    # of the line would be misread (this one runs touch); and the old arithmetic form
    ("echo $'\\'' ; touch /tmp/x ; echo \\'", None),
    ("printf '%s' $'a\\tb'", None),
    ("z=$[x]", None),
    ('echo "$[1+1]"', None),
    ("cat <<EOF\n$[x]\nEOF", None),
    ("echo $$$'x'", None),  # $$ then ANSI-C quoting
    # command substitution, in every spelling
    ("echo $(rm x)", None),
    ("echo `rm x`", None),
    ('echo "$(rm x)"', None),
    ('echo "`rm x`"', None),
    ("FOO=$(rm x) make", None),
    ("echo >$(rm x)", None),
    ("echo $((1 + 2))", None),
    ("echo ${ rm x; }", None),
    ('echo "$\\\n(rm x)"', None),
    ("cat <<EOF\n$(rm -rf /)\nEOF", None),
    ("[[ -n $(rm x) ]]", "[["),
    ("diff <(ls a) <(ls b)", None),
    ("tee >(rm x)", None),
    # what the guard does not read
    ("case $x in a) rm;; esac", "case"),
    ("function f { rm x; }", "function"),
    ("f() { rm x; }; f", None),
    ("a=(1 2); ls", None),
    ("((i++))", None),
    ("for ((i=0; i<3; i++)); do make; done", "for"),
    # wrappers that run a string
    ("env -S 'rm x' ls", "env"),
    ("env --split-string='rm x'", "env"),
    ("env --split 'rm x'", "env"),
    ("npx -c 'rm x'", "npx"),
    ("pnpm exec -c 'rm x'", "pnpm"),
    ("npx --unheard-of jest", "npx"),
    # names decided only when the shell runs
    ("$CMD -x", "$CMD"),
    ('"$PY" -m pytest', "$PY"),
    ("env A=$X make", "env"),
    ("env {A=1,rm} x", "env"),
    ("$'\\x72m' x", None),  # ANSI-C quoting is refused before the name is judged
    # not parseable
    ("echo 'unbalanced", None),
    ('echo "unbalanced', None),
    ("echo trailing\\", None),
    ("(make", None),
    ("make)", None),
    ("make >", None),
    ("cat <<", None),
    ("[[ -f x", "[["),
]


@pytest.mark.parametrize(("command", "names"), NAMED)
def test_the_names_of_a_command_line(command: str, names: list[str]) -> None:
    assert simple_command_names(command) == names


@pytest.mark.parametrize(("command", "name"), REFUSED)
def test_lines_the_guard_refuses_to_judge(command: str, name: str | None) -> None:
    with pytest.raises(GuardRefusal) as refused:
        simple_command_names(command)
    assert refused.value.command_name == name
    assert refused.value.message


def test_the_tables_are_large_enough_to_mean_something() -> None:
    assert len(NAMED) >= 30 and len(REFUSED) >= 30


def test_an_allowed_line_passes() -> None:
    check_allowed("FOO=1 npx jest && make 2>&1 | tee log", ["jest", "make", "tee"])


def test_wrappers_need_not_be_listed() -> None:
    check_allowed("env -i A=1 nice -n 5 time -p npm exec -- eslint .", ["eslint"])


def test_a_line_with_no_command_passes_any_list() -> None:
    check_allowed("A=1 # nothing runs", [])


def test_a_name_not_allowed_is_forbidden_and_named() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_allowed("make && rm -rf build", ["make"])
    assert failed.value.code == FORBIDDEN
    assert "'rm'" in failed.value.message
    assert failed.value.to_error() == {
        "code": FORBIDDEN,
        "message": failed.value.message,
        "command": "rm",
    }


def test_names_are_basenames_compared_exactly() -> None:
    check_allowed("/usr/local/bin/make", ["make"])
    with pytest.raises(ToolFailure):
        check_allowed("Make", ["make"])
    with pytest.raises(ToolFailure):
        check_allowed("make", ["/usr/bin/make"])


def test_a_syntax_refusal_is_forbidden_without_a_name() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_allowed("echo $(whoami)", ["echo", "whoami"])
    assert failed.value.code == FORBIDDEN
    assert "substitution" in failed.value.message
    assert failed.value.details == {"command": None}


def test_an_unbalanced_quote_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_allowed("echo 'oops", ["echo"])
    assert failed.value.code == FORBIDDEN
    assert "cannot be parsed" in failed.value.message


def test_a_refused_wrapper_option_names_the_wrapper() -> None:
    with pytest.raises(ToolFailure) as failed:
        check_allowed("env -S 'make test'", ["make"])
    assert failed.value.details == {"command": "env"}


# --- never anything but a refusal, whatever the text ---

_SHELL_PIECES = st.sampled_from(
    list("ab =$()`'\"\\;&|<>\n\t#{}![]-0123*?~,.")
    + ["<<", "<<-", "EOF", "env", "npx", "nice", "time", "npm", "exec", "-c", "-S", "-n"]
    + ["for", "do", "done", "if", "then", "fi", "[[", "]]", "case", "${", "$(", "\r", "\\\n"]
)
_TEXT = st.text(max_size=80) | st.lists(_SHELL_PIECES, max_size=40).map("".join)


@pytest.mark.fuzz
@fuzz_settings(1000)
@given(_TEXT)
def test_any_text_gives_names_or_a_refusal(command: str) -> None:
    try:
        names = simple_command_names(command)
    except GuardRefusal as refusal:
        assert isinstance(refusal.message, str) and refusal.message
    else:
        assert all(isinstance(name, str) for name in names)


@pytest.mark.fuzz
@fuzz_settings(1000)
@given(_TEXT, st.lists(st.sampled_from(["a", "b", "env", "make", ""]), max_size=3))
def test_check_allowed_raises_only_forbidden(command: str, allowed: list[str]) -> None:
    try:
        check_allowed(command, allowed)
    except ToolFailure as failure:
        assert failure.code == FORBIDDEN
        assert set(failure.details) in ({"command"}, {"command", "variable"})


# --- against bash itself: nothing runs that the guard did not name ---

_STUBS = ("a", "b", "c")
_BASH = "/bin/bash"
_LINE_TIMEOUT_S = 10.0
_RAN_LOG = "ran.log"
# Words and operators to build lines from. No "/": nothing outside the scratch directory can be
# named, and the stubs, env and nice are the only programs on PATH.
_WORDS = [*_STUBS, *_STUBS, "'a'", '"b"', "x", "X=1", "env", "nice", "time", "-i", "-n", "5", "-p"]
_OPERATORS = [
    ";", "&&", "||", "|", "&", "\n", "(", ")", "{", "}", "!", ">", "2>", ">&", "<<", "<<-",
    "EOF", "EOF\n", "'EOF'", "#", "$", "$(", "`", "'", '"', "\\", "\\\n", "if", "then", "fi",
    "[[", "]]", "for", "in", "do", "done", "$x", "*", "{a,b}", "[a]", "--", "\t",
]  # fmt: skip
_PIECE = st.sampled_from(_WORDS) | st.sampled_from(_OPERATORS)
_SOUP = st.lists(st.tuples(_PIECE, st.sampled_from(["", " ", " "])), min_size=1, max_size=12).map(
    lambda pieces: "".join(piece + blank for piece, blank in pieces)
)
# Lines shaped like real ones: commands (spelled in the ways the guard must see through, or
# hidden in the ways it must refuse) joined by separators, comments and here-documents.
_NAME = st.sampled_from([*_STUBS, "'a'", '"b"', "c\\\n", "\\\na", "`a`", "$(b)", "$x", "x"])
_PREFIX = st.sampled_from(
    ["", "", "X=1 ", "env ", "env X=1 ", "env -- ", "nice ", "nice -n 5 ", "time ", "time -p ",
     "time -- ", "! ", "time ! ", "{ ", "( ", "2>x ", "$x ", "env $x ", "'' "]
)  # fmt: skip
_ARGUMENT = st.sampled_from(
    ["x", "'x; b'", '"x && c"', "#", "a#b", ">x", "2>&1", "<<<a", "$x", "*", "\\;", "{a,b}"]
)
_JOINER = st.sampled_from(
    ["; ", " && ", " || ", " | ", " |& ", " & ", "\n", " # c; a\n", " #'\n", "\n#\n",
     " <<EOF\nb\nEOF\n", " <<-'EOF'\n\tc\n\tEOF\n", " <<E; c\na\nE\n", " <<E\n$(a)\nE\n",
     "; } ; ", ") ; ", " \\\n&& ", "; then ", "; do ", "; fi; ", "; done; "]
)  # fmt: skip
_COMMAND = st.tuples(_PREFIX, _NAME, st.lists(_ARGUMENT, max_size=2)).map(
    lambda parts: parts[0] + parts[1] + "".join(" " + argument for argument in parts[2])
)
_SHAPED = st.tuples(_COMMAND, st.lists(st.tuples(_JOINER, _COMMAND), max_size=4)).map(
    lambda parts: parts[0] + "".join(joiner + command for joiner, command in parts[1])
)


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PATH of stubs that append their name to `ran.log` next to them (even under env -i)."""
    directory = tmp_path_factory.mktemp("stubs")
    for name in _STUBS:
        stub = directory / name
        stub.write_text(f"#!/bin/sh\necho {name} >> '{directory / _RAN_LOG}'\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    for real in ("env", "nice"):
        (directory / real).symlink_to(shutil.which(real) or f"/usr/bin/{real}")
    return directory


def _run_in_bash(line: str, path: Path, cwd: Path) -> list[str]:
    """The stubs bash runs for `line`, background ones included."""
    log = path / _RAN_LOG
    log.write_text("")
    # Every process bash starts inherits this pipe; its EOF says they have all exited.
    read_end, write_end = os.pipe()
    while not set(str(write_end)) - {"2", "5"}:  # the lines can redirect descriptors 2, 5, 25 …
        write_end = os.dup(write_end)
    try:
        process = subprocess.Popen(
            [_BASH, "-c", line],
            cwd=cwd,
            env={"PATH": str(path)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(write_end,),
            start_new_session=True,
        )
    finally:
        os.close(write_end)
    # Nothing in the alphabet can loop or wait for input; this only bounds a bug.
    watchdog = threading.Timer(_LINE_TIMEOUT_S, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        with os.fdopen(read_end, "rb") as done:
            done.read()
        process.wait()
    finally:
        watchdog.cancel()
    return log.read_text().split()


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(line=_SHAPED | _SOUP)
def test_bash_runs_no_command_the_guard_did_not_name(
    line: str, stub_path: Path, tmp_path: Path
) -> None:
    try:
        names = simple_command_names(line)
    except GuardRefusal:
        event("refused")
        return
    scratch = tmp_path / "cwd"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    ran = _run_in_bash(line, stub_path, scratch)
    event(f"ran {min(len(ran), 2)}+ stubs")
    assert set(ran) <= set(names), (line, names, ran)
