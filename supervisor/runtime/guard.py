"""The `allowed_commands` guard of execute_shell_command (docs/protocol.md §7.4.2).

Before a command line is spawned, every simple command in it must name a program whose
basename is in `allowed_commands`. This is a guard against mistakes (an agent reaching for `rm`
or `curl` it was not meant to use), **not a security boundary**: the sandbox is the boundary.
A determined caller can always reach a shell through an allowed program (`xargs`, `find -exec`,
`sh`, `make`, a package.json script); listing such programs lets through whatever they run.

How a line is read: the standard library's `shlex` (POSIX mode, shell punctuation as separate
tokens) splits it into words and operator runs. shlex does not know three things a shell does,
so the guard adds them around it: a newline is an operator (shlex would call it whitespace),
`#` at the start of a word begins a comment up to the end of the line (shlex would also take a
`#` inside a word), and a here-document's body is text, not commands. For those, and to tell a
quoted word from a bare one (`"A=1"` is a command, `A=1` an assignment), each token keeps the
raw text it was read from.

Decisions (all err towards refusing; a refusal names the command or says what was not
understood, so the agent can rewrite the line):
- Separators `;`, `&`, `&&`, `||`, `|`, `|&` and newlines end a simple command; `;;`, `;&`,
  `;;&` too (outside `case` they are shell syntax errors, so nothing more runs).
- Command substitution `$(…)` and backticks, unquoted or in double quotes, are refused; in single
  quotes they are text. `$((…))` (arithmetic) is refused with them: it begins like one and can
  contain one; so is the old form `$[…]`. Unquoted ANSI-C quoting `$'…'` is refused: shlex
  does not know it, and would end the quote at an escaped `\'` where bash does not. So are process substitution `<(…)`/`>(…)` and bash 5.3's `${ …; }` and
  `${| …; }`, also in the body of a here-document whose delimiter is unquoted.
- Subshells `( … )` and groups `{ …; }` are looked into: their commands are checked like any
  other. `!` (negation) and the bash keyword `time` (with `-p`, `--`) before a pipeline are
  skipped. `((…))` is refused.
- `if/then/elif/else/fi`, `while/until/do/done` are skipped as keywords, so the commands they
  run are checked; `for NAME in WORDS` and `select` skip their header.
- Arithmetic contexts are refused: arithmetic evaluation runs the command substitutions of an
  array subscript it meets, even one written in single quotes or held in a variable
  (`[[ 'a[$(cmd)]' -eq 0 ]]` runs cmd). So `[[ … ]]` (all of it), `((…))`, `$((…))`, `$[…]`,
  `let`, `declare`/`typeset`/`local` (which set the integer attribute), `${name[…]}`,
  `${name:offset:length}`, `${!name}` and `${name@…}` are refused, and so is a literal
  subscripted name (`a[…]`) handed to a builtin that takes variable names (`read`,
  `printf -v`, `test -v`, `unset` …, see _NAME_TAKING_BUILTINS). `case`, `function` and `coproc` are refused: their syntax reuses `)` and `|` in
  ways a word-level reader cannot follow. A function definition `f() …` is refused as well.
- Redirections (`> f`, `>> f`, `2>&1`, `&> f`, `< f`, `<<< w`, `<< EOF` …) are stepped over
  with their target, wherever they stand in the simple command; their targets are not judged
  (files are the jail's and the sandbox's business). A command made only of redirections or
  assignments (`> out`, `A=1`) has no name and passes.
- Leading `NAME=value` assignments are skipped. Then wrappers are peeled: `env` (options such
  as `-i`, `-u NAME`, `-C DIR`, then `NAME=value` words), `nice` (`-n N`, `-N`), `time` after
  another wrapper (/usr/bin/time: `-p`, `-f FMT`, `-o FILE`), `npx`, `pnpx`, `bunx`,
  `npm exec`/`npm x`, `pnpm` and `yarn` (their option flags, then `exec`/`dlx`/`run`, and
  `yarn workspace NAME`). The first word left is the command; its basename
  (`/usr/bin/make` → `make`) must be allowed. Wrappers need not be listed, but a wrapper with
  nothing to wrap (`env` alone, `yarn` alone = `yarn install`) runs itself and must be.
- A wrapper option that runs a string the guard cannot see (`env -S`, `npx -c`, `pnpm exec -c`)
  is refused. A wrapper option the guard does not know is refused too, unless given as
  `--name=value`: guessing whether it takes a value could skip over the real command.
- Unbalanced quotes, a trailing backslash, an unclosed `(` or `[[`, a redirection without a
  target: refused ("cannot be parsed"), never an exception of another type.
- Names are compared exactly (case-sensitive, as the file system does). A command name, or any
  word of a wrapper before it, holding a `$` (outside single quotes), an unquoted glob or a
  brace expansion is refused: `$X rm` runs rm when X is empty, `env $X` may become `env -S …`,
  `{A=1,rm}` becomes two words. Only the shell knows what those name. Arguments after the
  command name are never judged.
- The environment a call sets (its `env`, and the bootstrap's `agent.env`) is checked too:
  names that make bash or a common tool run code (BASH_ENV, PS4, GIT_CONFIG_*, LD_PRELOAD,
  PATH …) are refused, per ENVIRONMENT_DENY_POLICY (see check_environment). So are the same
  names when the line assigns them: `PATH=/tmp ls`, `env NAME=…`, `export NAME`,
  `read NAME`, `printf -v NAME`.
- Long wrapper options may be abbreviated (getopt_long and npm accept unique prefixes), so a
  prefix of a refused option is refused too (`env --split`).
"""

from __future__ import annotations

import enum
import io
import re
import shlex
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from sandbox_supervisor.protocol.errors import FORBIDDEN
from sandbox_supervisor.daemon.runtime.failures import ToolFailure

__all__ = [
    "ENVIRONMENT_DENY_POLICY",
    "GuardRefusal",
    "check_allowed",
    "check_environment",
    "denied_environment_name",
    "simple_command_names",
]

# Characters shlex returns as operator runs. The newline is one: it separates commands.
_PUNCTUATION = "();<>|&\n"
# Blanks between words. "\r" is not among them: bash reads it as part of a word, and so must we.
_BLANKS = " \t"
_NEWLINE = "\n"
# Shell operators, longest first, for cutting a run such as "&&(" or ";\n" into operators.
_OPERATORS = (
    ";;&", "&>>", "<<<",
    "&&", "||", ";;", ";&", "|&", "&>", ">>", ">&", "<&", ">|", "<>", "<<",
    ";", "&", "|", "<", ">", "(", ")", _NEWLINE,
)  # fmt: skip
_SEPARATORS = frozenset({";", "&", "&&", "||", "|", "|&", ";;", ";&", ";;&", _NEWLINE})
_REDIRECTIONS = frozenset({"<", ">", ">>", ">|", "<>", ">&", "<&", "&>", "&>>", "<<", "<<<"})
_HEREDOC = "<<"
_SINGLE_QUOTE, _DOUBLE_QUOTE, _BACKSLASH = "'", '"', "\\"
_CONTINUATION = _BACKSLASH + _NEWLINE  # joins two lines, outside single quotes
_OPEN, _CLOSE = "(", ")"

# Keywords that only introduce or close a construct whose commands follow as simple commands.
_SKIPPED_KEYWORDS = frozenset(
    {"!", "{", "}", "if", "then", "elif", "else", "fi", "while", "until", "do", "done"}
)
_LOOP_HEADERS = frozenset({"for", "select"})  # `for NAME in WORDS ;` — the words are not commands
_LOOP_BODY = "do"
# Before a pipeline `time` is a bash keyword (only `-p`, then `--`, may follow it); elsewhere,
# as in `env time make`, it is the program /usr/bin/time and peeled as a wrapper.
_TIME = "time"
_TIME_OPTIONS = ("-p", "--")
_TEST_OPEN, _TEST_CLOSE = "[[", "]]"
_REFUSED_KEYWORDS = frozenset({"case", "esac", "function", "coproc"})
# Arithmetic evaluation runs the command substitutions in an array subscript it meets, even
# one written in single quotes or held in a variable: `[[ 'a[$(cmd)]' -eq 0 ]]` and
# `x='a[$(cmd)]'; let x` run cmd. `[[ … ]]` evaluates arithmetic for -eq/-lt/… and array
# subscripts for -v, and which operands it evaluates depends on operators a word reader
# cannot follow (`-eq` may come from a variable), so the whole conditional is refused; so
# are the builtins that evaluate arithmetic or give a variable the integer attribute (after
# which every assignment to it is evaluated). `[ … ]` and `test` compare integers without
# evaluating them (only their -v operand is evaluated: see _NAME_TAKING_BUILTINS).
_CONDITIONAL_REFUSED = (
    "'[[ … ]]' evaluates its operands as arithmetic (which runs command substitutions held in "
    "array subscripts), so the allowed_commands guard refuses it; use '[ … ]' or 'test'."
)
_ARITHMETIC_BUILTINS = frozenset({"let", "declare", "typeset", "local"})
# Builtins that take a variable name as an argument and evaluate its array subscript as
# arithmetic when it has one (read NAME, printf -v NAME, test -v NAME, unset NAME, …).
# The value is the option whose operand is the name, or None when any argument may be one.
_NAME_TAKING_BUILTINS: dict[str, frozenset[str] | None] = {
    "test": frozenset({"-v", "-R"}),
    "[": frozenset({"-v", "-R"}),
    "printf": frozenset({"-v"}),
    "wait": frozenset({"-p"}),
    "read": None,
    "unset": None,
    "mapfile": None,
    "readarray": None,
    "getopts": None,
    "export": None,
    "readonly": None,
}
# Name-taking builtins that assign the variable: the names meet the deny policy too.
_ASSIGNING_BUILTINS = frozenset({"read", "printf", "mapfile", "readarray", "getopts", "wait"})
# Builtins whose arguments name variables to set or export: their names meet the deny policy.
_EXPORTING_BUILTINS = frozenset({"export", "readonly"})
_SUBSCRIPTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\[")
# `${name[…]}` (a subscript) and `${name:offset:length}` (a substring) evaluate arithmetic.
# Only `${name:-…}`, `${name:=…}`, `${name:?…}` and `${name:+…}` use a colon otherwise.
_PARAMETER = re.compile(r"\$\{[#!]?([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?P<after>.?)(?P<next>.?)", re.DOTALL)
_COLON_OPERATORS = "-=?+"

# A shell assignment: an unquoted name, then "=" or "+=".
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")
_FD_NUMBER = re.compile(r"[0-9]+")
_NICE_ADJUSTMENT = re.compile(r"-[-+]?[0-9]+")
_BRACE_EXPANSION = re.compile(r"\{[^}]*(,|\.\.)[^}]*\}")

_END_OF_OPTIONS = "--"

_SUBSTITUTION_REFUSED = (
    "Command substitution ($(…) or `…`) is not allowed by the allowed_commands guard."
)
_PROCESS_SUBSTITUTION_REFUSED = (
    "Process substitution (<(…) or >(…)) is not allowed by the allowed_commands guard."
)


class GuardRefusal(Exception):
    """The command line may not run; `command_name` is the offending name when there is one."""

    def __init__(self, message: str, command_name: str | None = None, variable: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.command_name = command_name
        self.variable = variable  # an environment variable the line sets that the policy denies


def check_allowed(command: str, allowed: Sequence[str]) -> None:
    """Raise ToolFailure(forbidden) unless every simple command of `command` is allowed.

    details: `{"command": name}`, the first name not allowed (None when the line was refused
    for its syntax, e.g. command substitution or unbalanced quotes), and `variable` when the
    line assigns an environment variable the deny policy refuses (`PATH=/tmp ls`).
    """
    try:
        names = simple_command_names(command)
    except GuardRefusal as refusal:
        details: dict[str, str | None] = {"command": refusal.command_name}
        if refusal.variable is not None:
            details["variable"] = refusal.variable
        raise ToolFailure(FORBIDDEN, refusal.message, details) from None
    permitted = frozenset(allowed)
    for name in names:
        if name not in permitted:
            raise ToolFailure(
                FORBIDDEN, f"Command {name!r} is not in allowed_commands.", {"command": name}
            )


# --- the environment a guarded call may set ---
#
# A guarded command runs with the environment of build_environment in shell.py: the default
# PATH, base_env (the operator's), the command user's passwd entry, then the bootstrap's
# agent.env, then the call's env, and never in a login shell (shell.uses_login_shell: the
# profile files are the agent's to write). The last two come
# from the caller, and many names make bash or a common tool run code no command line shows
# (`BASH_ENV='$(cmd)'` runs cmd before `ls` does). When allowed_commands is set, a name from
# agent.env or the call's env is refused when it is denied below. base_env is the operator's
# configuration and is not judged.


class _Match(enum.Enum):
    EXACT = "exact"
    PREFIX = "prefix"
    SUFFIX = "suffix"


@dataclass(frozen=True, slots=True)
class EnvironmentRule:
    match: _Match
    names: tuple[str, ...]  # upper case; a name is compared upper-cased
    reason: str


# Each family of names, with why it is denied. Names are compared upper-cased (npm reads its
# npm_config_* in any case, and a lower-case twin of a denied name is never needed), and any
# name that is not a shell identifier is denied too (bash imports `BASH_FUNC_f%%` as the
# function f, and such names are never plain variables).
ENVIRONMENT_DENY_POLICY: tuple[EnvironmentRule, ...] = (
    EnvironmentRule(_Match.EXACT, ("BASH_ENV", "ENV"), "bash -c (and sh) source or expand this file name at start-up"),
    EnvironmentRule(_Match.EXACT, ("SHELLOPTS", "BASHOPTS"), "imported shell options (xtrace, and with it PS4, among them)"),
    EnvironmentRule(
        _Match.EXACT,
        ("PS0", "PS1", "PS2", "PS3", "PS4", "PROMPT_COMMAND", "BASH_XTRACEFD"),
        "prompt and trace strings undergo command substitution",
    ),
    EnvironmentRule(_Match.PREFIX, ("BASH_FUNC_",), "exported shell functions replace commands by name"),
    EnvironmentRule(
        _Match.EXACT,
        ("IFS", "CDPATH", "GLOBIGNORE", "EXECIGNORE", "TMOUT", "BASH_COMPAT", "BASH_LOADABLES_PATH", "POSIXLY_CORRECT"),
        "changes how bash splits, expands, finds or times out what the guard read",
    ),
    EnvironmentRule(_Match.EXACT, ("PATH",), "chooses which binary an allowed name runs"),
    EnvironmentRule(_Match.EXACT, ("SHELL",), "tools run their sub-commands with it"),
    EnvironmentRule(
        _Match.EXACT,
        ("HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS"),
        "tools read their configuration from files under it (git's core.fsmonitor, npm's script-shell)",
    ),
    EnvironmentRule(_Match.PREFIX, ("LD_",), "the dynamic loader preloads or audits libraries named here"),
    EnvironmentRule(_Match.EXACT, ("GCONV_PATH", "LOCPATH", "HOSTALIASES"), "glibc loads modules or files named here"),
    EnvironmentRule(
        _Match.PREFIX,
        ("GIT_",),
        "git configuration, hooks, helpers and the repository it reads (core.fsmonitor, "
        "GIT_SSH_COMMAND, GIT_EXTERNAL_DIFF, GIT_EXEC_PATH …), except the names in "
        "ENVIRONMENT_ALLOWED_EXCEPTIONS",
    ),
    EnvironmentRule(
        _Match.SUFFIX,
        ("_COMMAND", "_ASKPASS", "_EDITOR", "_PAGER", "_WRAPPER", "_SHELL"),
        "a program that a tool runs on its own (SSH_ASKPASS, RUSTC_WRAPPER, SYSTEMD_PAGER …)",
    ),
    EnvironmentRule(
        _Match.EXACT,
        ("PAGER", "MANPAGER", "EDITOR", "VISUAL", "BROWSER", "LESSOPEN", "LESSCLOSE", "ASKPASS"),
        "a program that a tool runs on its own",
    ),
    EnvironmentRule(
        _Match.PREFIX,
        ("PYTHON",),
        "Python startup files, import paths, breakpoint hooks and warning filters import code, "
        "except the names in ENVIRONMENT_ALLOWED_EXCEPTIONS",
    ),
    EnvironmentRule(_Match.PREFIX, ("PERL",), "PERL5OPT, PERL5LIB, PERL5DB load code into every perl"),
    EnvironmentRule(_Match.PREFIX, ("RUBY",), "RUBYOPT, RUBYLIB load code into every ruby"),
    EnvironmentRule(
        _Match.PREFIX, ("NODE_",), "NODE_OPTIONS (--require) and NODE_PATH load code into every node, except NODE_ENV"
    ),
    EnvironmentRule(_Match.PREFIX, ("NPM_CONFIG_",), "npm settings choose the shell and node options scripts run with"),
    EnvironmentRule(
        _Match.EXACT,
        ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "LUA_INIT", "PHPRC", "PHP_INI_SCAN_DIR"),
        "options or start-up code every run of the interpreter takes",
    ),
    EnvironmentRule(_Match.EXACT, ("MAKEFLAGS", "MFLAGS", "GNUMAKEFLAGS"), "make takes variable definitions (SHELL) from them"),
)
# Names inside a denied family that run nothing: identity and dates for commits, and output
# settings of Python and node.
ENVIRONMENT_ALLOWED_EXCEPTIONS = frozenset(
    {
        "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_AUTHOR_DATE",
        "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "GIT_COMMITTER_DATE",
        "GIT_TERMINAL_PROMPT", "GIT_OPTIONAL_LOCKS",
        "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONIOENCODING",
        "PYTHONUTF8", "PYTHONFAULTHANDLER",
        "NODE_ENV", "NODE_NO_WARNINGS",
    }
)  # fmt: skip
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_AN_IDENTIFIER = "not a shell identifier (bash imports BASH_FUNC_name%% as a function)"


def denied_environment_name(name: str) -> str | None:
    """Why a guarded call may not set the environment variable `name`, or None if it may."""
    if not _IDENTIFIER.fullmatch(name):
        return _NOT_AN_IDENTIFIER
    upper = name.upper()
    if upper in ENVIRONMENT_ALLOWED_EXCEPTIONS:
        return None
    for rule in ENVIRONMENT_DENY_POLICY:
        if rule.match is _Match.EXACT and upper in rule.names:
            return rule.reason
        if rule.match is _Match.PREFIX and upper.startswith(rule.names):
            return rule.reason
        if rule.match is _Match.SUFFIX and upper.endswith(rule.names):
            return rule.reason
    return None


def check_environment(names: Iterable[str], source: str) -> None:
    """Raise ToolFailure(forbidden) for the first name the deny policy refuses.

    `source` says where the name came from ("env" or "agent.env"); details:
    `{"command": None, "variable": name}`.
    """
    for name in names:
        reason = denied_environment_name(name)
        if reason is not None:
            raise ToolFailure(
                FORBIDDEN,
                f"The environment variable {name!r} ({source}) is not allowed with "
                f"allowed_commands: {reason}.",
                {"command": None, "variable": name},
            )


def simple_command_names(command: str) -> list[str]:
    """The basename of the program each simple command of `command` runs, in order.

    Raises GuardRefusal for what the guard refuses to judge (see the module docstring).
    """
    return _Reader(command).names()


# --- tokens ---


@dataclass(frozen=True, slots=True)
class _Word:
    value: str  # as the shell passes it on: quotes removed
    raw: str  # the text it was read from, from its first character (may end with one blank)
    start: int

    @property
    def bare(self) -> bool:
        """Written without quotes or escapes, so a keyword or an assignment if it reads as one."""
        return self.raw.rstrip(_BLANKS) == self.value


@dataclass(frozen=True, slots=True)
class _Operator:
    value: str
    start: int


_Token = _Word | _Operator


@dataclass(slots=True)
class _Heredoc:
    delimiter: str
    strip_tabs: bool  # `<<-`
    expands: bool  # unquoted delimiter: the body undergoes $( ) and backtick substitution


class _Lexer:
    """shlex over the whole line, restarted past comments and here-document bodies."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._stream = io.StringIO(text, newline="")  # tell() and seek() are character indexes
        self._queue: deque[_Token] = deque()
        self.heredocs: list[_Heredoc] = []  # announced on this line; bodies follow its newline
        self._start(0)

    def _start(self, position: int) -> None:
        self._queue.clear()
        self._resume_at: int | None = None
        self._position = position
        self._stream.seek(position)
        lexer = shlex.shlex(self._stream, posix=True, punctuation_chars=_PUNCTUATION)
        lexer.whitespace = _BLANKS
        lexer.whitespace_split = True
        lexer.commenters = ""  # shlex would take "#" inside a word and eat the newline
        self._shlex = lexer
        self._skip_comment()

    def _skip_comment(self) -> None:
        """At a word start, `#` opens a comment: resume at the newline that ends it."""
        text, index = self._text, self._position
        while index < len(text) and text[index] in _BLANKS:
            index += 1
        if index < len(text) and text[index] == "#":
            newline = text.find(_NEWLINE, index)
            self._resume_at = len(text) if newline < 0 else newline

    def next(self) -> _Token | None:
        while True:
            if self._queue:
                token = self._queue.popleft()
                if isinstance(token, _Operator) and token.value == _NEWLINE and self.heredocs:
                    self._start(self._skip_heredoc_bodies(token.start + 1))
                return token
            if self._resume_at is not None:
                self._start(self._resume_at)
                continue
            if not self._read():
                return None

    def _read(self) -> bool:
        """Queue the tokens of one shlex token; False at the end of the text."""
        before = self._position
        try:
            value = self._shlex.get_token()
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise GuardRefusal(f"The command cannot be parsed: {exc}.") from None
        if value is None:
            return False
        # shlex reads one character past a token; punctuation it pushes back for the next one.
        # No public accessor, and typeshed does not declare the attribute: read it by name.
        pushed_back = len(getattr(self._shlex, "_pushback_chars"))
        self._position = self._stream.tell() - pushed_back
        raw = self._text[before : self._position]
        stripped = raw.lstrip(_BLANKS)
        start = before + len(raw) - len(stripped)
        if value and stripped.startswith(value) and all(c in _PUNCTUATION for c in value):
            self._queue.extend(_split_operators(value, start))
        else:
            word = _read_word(value, stripped, start)
            if word is not None:
                self._queue.append(word)
        self._skip_comment()
        return True

    def _skip_heredoc_bodies(self, position: int) -> int:
        """Step over the bodies announced on the line just ended; where the next line starts."""
        text = self._text
        for heredoc in self.heredocs:
            body: list[str] = []
            while position < len(text):
                end = text.find(_NEWLINE, position)
                end = len(text) if end < 0 else end
                line = text[position:end]
                position = end + 1
                if (line.lstrip("\t") if heredoc.strip_tabs else line) == heredoc.delimiter:
                    break
                body.append(line)
            joined = _join_continuations(_NEWLINE.join(body), quotes=False)
            if heredoc.expands and _substitutes(joined, in_heredoc=True):
                raise GuardRefusal(
                    "Command substitution in a here-document is not allowed by the "
                    "allowed_commands guard (quote the delimiter, as in <<'EOF', to pass the "
                    "text as it is)."
                )
            construct = _unreadable_dollar(joined, in_heredoc=True) if heredoc.expands else None
            if construct is not None:
                raise GuardRefusal(
                    f"{construct} in a here-document is not allowed by the allowed_commands "
                    "guard (quote the delimiter, as in <<'EOF', to pass the text as it is)."
                )
        self.heredocs.clear()
        return min(position, len(text))


def _split_operators(run: str, start: int) -> Iterator[_Operator]:
    index = 0
    while index < len(run):
        operator = next(op for op in _OPERATORS if run.startswith(op, index))
        yield _Operator(operator, start + index)
        index += len(operator)


def _read_word(value: str, raw: str, start: int) -> _Word | None:
    """The word, or None for a bare line continuation; refuses substitutions."""
    if "\\\n" in raw:
        # A backslash-newline outside single quotes joins lines before anything else is read;
        # shlex keeps the newline, so the word is read again from the joined text.
        raw = _join_continuations(raw, quotes=True)
        try:
            parts = shlex.split(raw, comments=False, posix=True)
        except ValueError as exc:
            raise GuardRefusal(f"The command cannot be parsed: {exc}.") from None
        if not parts:
            return None
        value = "".join(parts)
    if _substitutes(raw, in_heredoc=False):
        raise GuardRefusal(f"{_SUBSTITUTION_REFUSED[:-1]}: {raw.strip()!r}.")
    construct = _unreadable_dollar(raw)
    if construct is not None:
        raise GuardRefusal(f"{construct} is not allowed by the allowed_commands guard: {raw.strip()!r}.")
    return _Word(value, raw, start)


def _unreadable_dollar(raw: str, *, in_heredoc: bool = False) -> str | None:
    """Name a `$` form that shlex misreads, outside single quotes, or None (in the body of
    a here-document with an unquoted delimiter, `$[…]` only: quotes are text there).

    - `$'…'` (ANSI-C quoting, unquoted): `\\'` escapes a quote inside it, which shlex takes
      as the quote's end, so the two would disagree on where commands start
      (`echo $'\\'' ; rm x ; echo \\'` runs rm).
    - `$[…]` (old arithmetic, also in double quotes): evaluated like `$((…))`, which is
      refused, and an array subscript in it runs command substitutions held in variables.
    """
    after_pid = -1  # the second "$" of "$$" (the shell's pid) begins nothing
    for index, quote in _live_characters(raw, in_heredoc=in_heredoc):
        pair = raw[index : index + 2]
        if index == after_pid:
            continue
        if pair == "$$":
            after_pid = index + 1
        elif pair == "$'" and quote is None and not in_heredoc:
            return "ANSI-C quoting ($'…')"
        elif pair == "$[":
            return "Arithmetic expansion ($[…])"
        elif pair == "${":
            construct = _arithmetic_parameter(raw, index)
            if construct is not None:
                return construct
    return None


def _arithmetic_parameter(raw: str, index: int) -> str | None:
    """Name the arithmetic in the parameter expansion at `raw[index]` ("${"), or None."""
    match = _PARAMETER.match(raw, index)
    if match is None:
        return None  # `${ cmd; }` and other forms are refused or judged elsewhere
    if raw.startswith("${!", index):
        # `${!x}` expands the parameter x names, and `x='a[$(cmd)]'` makes that a subscript.
        return "An indirect expansion (${!name})"
    if match["after"] == "@":
        # `${x@P}` expands x's value as a prompt string, command substitutions included.
        return "A parameter transformation (${name@…})"
    if match["after"] == "[":
        return "An array subscript (${name[…]}, evaluated as arithmetic)"
    if match["after"] == ":" and match["next"] not in tuple(_COLON_OPERATORS):
        return "A substring expansion (${name:offset:length}, evaluated as arithmetic)"
    return None


def _substitutes(raw: str, *, in_heredoc: bool) -> bool:
    """Does `raw` hold `$(`, `${ ` or a backtick outside single quotes (and not escaped)?"""
    for index, _ in _live_characters(raw, in_heredoc=in_heredoc):
        char, following = raw[index], raw[index + 1 : index + 2]
        if char == "`" or (char == "$" and following == "("):
            return True
        if char == "$" and following == "{":
            after = raw[index + 2 : index + 3]
            if after in ("", " ", "\t", "\n", "|"):
                return True  # bash 5.3 runs `${ cmd; }` and `${| cmd; }` in the shell itself
    return False


# --- quoting: one scanner ---
#
# Three questions need to know how the shell reads a word's quoting: which characters it may
# still expand ($, backticks, globs), and where a backslash-newline joins lines. They all walk
# the same small state machine, here:
#
#   state    on '        on "        on \            on any other character
#   bare     → single    → double    escape the next  live
#   double   live        → bare      escape the next  live
#   single   → bare      text        text             text
#
# A quote character that opens or closes a quote is a live unit itself (nothing expands in
# it, but it is not text). In the body of a here-document quotes are text: only the
# backslash escapes, so the state never leaves bare.


class _Role(enum.Enum):
    LIVE = "live"  # outside single quotes and not escaped: the shell may expand it
    ESCAPED = "escaped"  # a backslash and the character it escapes (just the backslash at the end)
    QUOTED = "quoted"  # inside single quotes, the closing quote included: plain text


# One unit: where it starts, its role, and the quote it stands in (None, '"' or "'"). An
# ESCAPED unit is two characters long (one at the very end), every other unit one.
_Unit = tuple[int, _Role, str | None]


def _scan(raw: str, *, quotes: bool = True) -> Iterator[_Unit]:
    """`raw` cut into units as the shell reads its quoting (the table above); with
    `quotes=False`, a here-document body, quote characters are plain text."""
    live, escaped, quoted = _Role.LIVE, _Role.ESCAPED, _Role.QUOTED  # hot loop: locals
    quote: str | None = None
    index = 0
    while index < len(raw):
        char = raw[index]
        if quote == _SINGLE_QUOTE:
            yield index, quoted, quote
            if char == _SINGLE_QUOTE:
                quote = None
            index += 1
        elif char == _BACKSLASH:
            yield index, escaped, quote
            index += 2
        else:
            yield index, live, quote
            if quotes and char == _SINGLE_QUOTE and quote is None:
                quote = _SINGLE_QUOTE
            elif quotes and char == _DOUBLE_QUOTE:
                quote = None if quote == _DOUBLE_QUOTE else _DOUBLE_QUOTE
            index += 1


def _live_characters(raw: str, *, in_heredoc: bool) -> Iterator[tuple[int, str | None]]:
    """Indexes of the characters the shell may expand, each with the quote it stands in
    (None, or '"')."""
    live = _Role.LIVE
    for index, role, quote in _scan(raw, quotes=not in_heredoc):
        if role is live:
            yield index, quote


def _join_continuations(raw: str, *, quotes: bool) -> str:
    """`raw` without its backslash-newlines (kept inside single quotes when `quotes`)."""
    out: list[str] = []
    for index, role, _ in _scan(raw, quotes=quotes):
        if role is _Role.ESCAPED:
            pair = raw[index : index + 2]  # an escaped character stays as it is
            if pair != _CONTINUATION:
                out.append(pair)
        else:
            out.append(raw[index])
    return "".join(out)


# --- wrappers ---


@dataclass(frozen=True, slots=True)
class _Wrapper:
    """A program that runs the command named by its first non-option argument."""

    flags: frozenset[str] = frozenset()  # options without a value
    valued: frozenset[str] = frozenset()  # options whose value is the next word (or attached)
    refused: frozenset[str] = frozenset()  # options that run a string the guard cannot see
    numeric_flags: bool = False  # nice -5, nice --10
    dash_is_option: bool = False  # env - (same as -i)
    assignments: bool = False  # env NAME=value …
    subcommands: frozenset[str] = frozenset()  # stepped over: pnpm exec, yarn run
    subcommands_with_argument: frozenset[str] = frozenset()  # yarn workspace NAME


def _options(*names: str) -> frozenset[str]:
    return frozenset(names)


_NPX = _Wrapper(
    flags=_options(
        "-y", "--yes", "--no", "--no-yes", "-q", "--quiet", "-s", "--silent",
        "--prefer-offline", "--prefer-online", "--offline", "--no-install",
        "--ignore-existing", "-ws", "--ws", "--workspaces", "--include-workspace-root",
    ),
    valued=_options(
        "-p", "--package", "-w", "--workspace", "--registry", "--cache", "--prefix",
        "--userconfig", "--loglevel",
    ),
    refused=_options("-c", "--call", "--shell"),
)  # fmt: skip
_PNPM_FLAGS = _options(
    "-r", "--recursive", "-w", "--workspace-root", "-s", "--silent", "--parallel", "--stream",
    "--if-present", "--aggregate-output", "--bail", "--no-bail", "--frozen-lockfile",
    "--prefer-offline", "--offline", "--color", "--no-color", "--sequential", "--reverse",
    "--shamefully-hoist", "-y", "--yes",
)  # fmt: skip
_PNPM_VALUED = _options(
    "-C", "--dir", "-F", "--filter", "--filter-prod", "--reporter", "--loglevel", "--package",
    "--resume-from", "--workspace-concurrency", "--test-pattern",
)  # fmt: skip
_PNPM_REFUSED = _options("-c", "--shell-mode")
_WRAPPERS: dict[str, _Wrapper] = {
    "env": _Wrapper(
        flags=_options(
            "-i", "--ignore-environment", "-0", "--null", "-v", "--debug",
            "--list-signal-handling", "--block-signal", "--default-signal", "--ignore-signal",
            "--help", "--version",
        ),
        valued=_options("-u", "--unset", "-C", "--chdir", "-a", "--argv0"),
        refused=_options("-S", "--split-string"),
        dash_is_option=True,
        assignments=True,
    ),
    "nice": _Wrapper(
        flags=_options("--help", "--version"),
        valued=_options("-n", "--adjustment"),
        numeric_flags=True,
    ),
    "time": _Wrapper(
        flags=_options(
            "-p", "--portability", "-a", "--append", "-v", "--verbose", "-q", "--quiet",
            "--help", "-V", "--version",
        ),
        valued=_options("-f", "--format", "-o", "--output"),
    ),
    "npx": _NPX,
    "bunx": _Wrapper(
        flags=_options("--bun", "--silent", "--verbose", "--no-install", "-b"),
        valued=_options("-p", "--package"),
    ),
    "pnpx": _Wrapper(flags=_PNPM_FLAGS, valued=_PNPM_VALUED, refused=_PNPM_REFUSED),
    "pnpm": _Wrapper(
        flags=_PNPM_FLAGS,
        valued=_PNPM_VALUED,
        refused=_PNPM_REFUSED,
        subcommands=_options("exec", "dlx", "run"),
    ),
    "yarn": _Wrapper(
        flags=_options(
            "-s", "--silent", "--frozen-lockfile", "--immutable", "--offline", "--verbose",
            "-T", "--top-level", "-B", "--binaries-only", "-q", "--quiet",
        ),
        valued=_options("--cwd", "-p", "--package"),
        subcommands=_options("run", "dlx"),
        subcommands_with_argument=_options("workspace"),
    ),
}  # fmt: skip
_NPM = "npm"
_NPM_EXEC = _options("exec", "x")


def _basename(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _command_name(words: list[_Word]) -> str | None:
    """The program a simple command runs: past assignments and wrappers; None if it has none."""
    index = 0
    # The name must be bare for an assignment (`"A=1"` is a command), the value may be quoted.
    while index < len(words) and _ASSIGNMENT.match(words[index].raw):
        # `PATH=/tmp ls` or `GIT_CONFIG_COUNT=1 … git status`: the same names as a call's env.
        _check_assigned_name(words[index].raw.split("=", 1)[0].removesuffix("+"))
        index += 1
    first = index
    name = None
    while index < len(words):
        name = _basename(words[index].value)
        if name == _NPM and index + 1 < len(words) and words[index + 1].value in _NPM_EXEC:
            wrapper, index = _NPX, index + 2
        elif name in _WRAPPERS:
            wrapper, index = _WRAPPERS[name], index + 1
        else:
            break
        before = index
        index = _past_wrapper(name, wrapper, [word.value for word in words], index)
        if wrapper.assignments:  # env NAME=value …: any NAME, identifiers or not
            for word in words[before:index]:
                # A word the shell expands is refused below, for what it may become.
                if "=" in word.value and not word.value.startswith("-") and not _expands(word.raw):
                    _check_assigned_name(word.value.split("=", 1)[0])
    for word in words[first : index + 1]:
        if _expands(word.raw):
            # `$X rm` runs rm when X is empty; `env $X` may become `env -S …`; `{A=1,rm}`
            # becomes two words. What runs is only known once the shell has expanded them.
            raise GuardRefusal(
                f"{word.value!r} is expanded by the shell when it runs, so the allowed_commands "
                "guard cannot tell which command it names; write the command name literally.",
                _basename(words[first].value),
            )
    return name


def _past_wrapper(name: str, wrapper: _Wrapper, args: list[str], index: int) -> int:
    """Index of the first word the wrapper runs (len(args) when there is none)."""
    while True:
        index = _past_options(name, wrapper, args, index)
        if wrapper.assignments:
            while index < len(args) and "=" in args[index]:
                index += 1  # env sets every argument with "=" before the command
        if index < len(args) and args[index] in wrapper.subcommands:
            index += 1
        elif index < len(args) and args[index] in wrapper.subcommands_with_argument:
            index += 2
        else:
            return index


def _past_options(name: str, wrapper: _Wrapper, args: list[str], index: int) -> int:
    while index < len(args):
        arg = args[index]
        if arg == _END_OF_OPTIONS:
            return index + 1
        if arg == "-" and wrapper.dash_is_option:
            index += 1
        elif not arg.startswith("-") or arg == "-":
            return index
        elif arg in wrapper.flags or (wrapper.numeric_flags and _NICE_ADJUSTMENT.fullmatch(arg)):
            index += 1
        elif arg.startswith("--"):
            index += _long_option(name, wrapper, arg)
        else:
            index += _short_options(name, wrapper, arg)
    return index


def _long_option(name: str, wrapper: _Wrapper, arg: str) -> int:
    """How many words `--option[=value]` takes (1 or 2)."""
    option, inline, _ = arg.partition("=")
    if any(r.startswith(option) for r in wrapper.refused if r.startswith("--")):
        raise _refused_option(name, arg)
    if inline:
        return 1  # the value is attached, so the next word is not consumed either way
    matches = {o for o in wrapper.flags | wrapper.valued if o == option} or {
        o for o in wrapper.flags | wrapper.valued if o.startswith(option) and len(option) > 2
    }
    if len(matches) != 1:
        raise _unknown_option(name, arg)
    return 2 if matches <= wrapper.valued else 1


def _short_options(name: str, wrapper: _Wrapper, arg: str) -> int:
    """How many words a cluster such as `-iu NAME` or `-n5` takes (1 or 2)."""
    for position, letter in enumerate(arg[1:], start=1):
        option = "-" + letter
        if option in wrapper.refused:
            raise _refused_option(name, arg)
        if option in wrapper.valued:
            attached = position + 1 < len(arg)
            return 1 if attached else 2
        if option not in wrapper.flags:
            raise _unknown_option(name, arg)
    return 1


def _refused_option(name: str, arg: str) -> GuardRefusal:
    return GuardRefusal(
        f"{name} {arg} runs a command string the allowed_commands guard cannot check.", name
    )


def _unknown_option(name: str, arg: str) -> GuardRefusal:
    return GuardRefusal(
        f"The allowed_commands guard does not know the {name} option {arg!r}, so it cannot "
        f"tell which command {name} runs; write it as --option=value or drop it.",
        name,
    )


# --- the reader: tokens → simple commands ---


class _Reader:
    def __init__(self, command: str) -> None:
        self._lexer = _Lexer(command)
        self._names: list[str] = []
        self._words: list[_Word] = []  # of the simple command being read
        self._begun = False  # a word, redirection or test of this simple command was seen
        self._time_options: tuple[str, ...] = ()  # still acceptable after the `time` keyword
        self._depth = 0  # open subshells
        self._previous: _Token | None = None  # the last token read before the current one

    def names(self) -> list[str]:
        while (token := self._lexer.next()) is not None:
            self._previous = self._token(token)
        self._end_command()
        if self._depth:
            raise GuardRefusal("The command cannot be parsed: '(' is not closed.")
        return self._names

    def _token(self, token: _Token) -> _Token:
        """Handle one token (and any it consumes); the last token consumed."""
        if isinstance(token, _Word):
            self._word(token)
        elif token.value in _SEPARATORS:
            self._end_command()
        elif token.value in _REDIRECTIONS:
            return self._redirection(token)
        elif token.value == _OPEN:
            self._open(token)
        else:  # _CLOSE
            self._end_command()
            self._depth -= 1
            if self._depth < 0:
                raise GuardRefusal("The command cannot be parsed: ')' without '('.")
        return token

    def _word(self, word: _Word) -> None:
        if self._begun or not word.bare:
            pass
        elif word.value in _SKIPPED_KEYWORDS:
            return
        elif word.value == _TIME:
            self._time_options = _TIME_OPTIONS
            return
        elif word.value in self._time_options:  # `-p` then `--`, each optional, in that order
            self._time_options = self._time_options[self._time_options.index(word.value) + 1 :]
            return
        elif word.value in _REFUSED_KEYWORDS:
            raise GuardRefusal(
                f"The shell keyword {word.value!r} is not supported by the allowed_commands "
                "guard; run the commands it would run directly.",
                word.value,
            )
        elif word.value in _LOOP_HEADERS:
            self._skip_loop_header(word.value)
            return
        elif word.value == _TEST_OPEN:
            raise GuardRefusal(_CONDITIONAL_REFUSED, _TEST_OPEN)
        elif word.value in _ARITHMETIC_BUILTINS:
            raise GuardRefusal(
                f"{word.value!r} evaluates arithmetic (which runs command substitutions held "
                "in array subscripts), so the allowed_commands guard refuses it.",
                word.value,
            )
        self._words.append(word)
        self._begun = True

    def _redirection(self, operator: _Operator) -> _Token:
        previous = self._previous
        if (
            isinstance(previous, _Word)
            and self._words
            and self._words[-1] is previous
            and previous.raw == previous.value
            and _FD_NUMBER.fullmatch(previous.value)
        ):
            self._words.pop()  # `2>`: digits glued to the operator name a file descriptor
        self._begun = True
        target = self._lexer.next()
        if isinstance(target, _Operator) and target.value == _OPEN:
            raise GuardRefusal(_PROCESS_SUBSTITUTION_REFUSED)
        if not isinstance(target, _Word):
            raise GuardRefusal(f"The command cannot be parsed: {operator.value!r} has no target.")
        if operator.value == _HEREDOC:
            # `<<-EOF` reaches us as `<<` and the word `-EOF`; `<<- EOF` as `<<`, `-`, `EOF`;
            # `<< -EOF` (a blank after `<<`) means the delimiter `-EOF`.
            adjacent = target.start == operator.start + len(_HEREDOC)
            strip_tabs = adjacent and target.raw.startswith("-")
            if strip_tabs and target.bare and target.value == "-":
                target = self._lexer.next()
                if not isinstance(target, _Word):
                    raise GuardRefusal("The command cannot be parsed: '<<-' has no delimiter.")
                self._lexer.heredocs.append(_heredoc(target, strip_tabs=True))
            elif strip_tabs:
                delimiter = _Word(target.value[1:], target.raw[1:], target.start + 1)
                self._lexer.heredocs.append(_heredoc(delimiter, strip_tabs=True))
            else:
                self._lexer.heredocs.append(_heredoc(target, strip_tabs=False))
        return target

    def _open(self, token: _Operator) -> None:
        previous = self._previous
        if isinstance(previous, _Word) and previous.raw.endswith("$"):
            raise GuardRefusal(_SUBSTITUTION_REFUSED)
        if self._begun:
            raise GuardRefusal(
                "'(' after a word (a function definition or an array) is not supported by the "
                "allowed_commands guard."
            )
        if (
            isinstance(previous, _Operator)
            and previous.value == _OPEN
            and previous.start + 1 == token.start
        ):
            raise GuardRefusal("Arithmetic commands '((…))' are not supported by the guard.")
        self._depth += 1

    def _skip_loop_header(self, keyword: str) -> None:
        """Step over `for NAME in WORDS`: its words are values, not commands."""
        while (token := self._lexer.next()) is not None:
            if isinstance(token, _Word) and token.bare and token.value == _LOOP_BODY:
                return  # `for x do …`: the body starts here
            if isinstance(token, _Operator):
                if token.value in (";", _NEWLINE):
                    return
                raise GuardRefusal(f"This {keyword!r} loop is not supported by the guard.", keyword)
        raise GuardRefusal(f"The command cannot be parsed: {keyword!r} is not finished.", keyword)

    def _end_command(self) -> None:
        if self._words:
            name = _command_name(self._words)
            if name is not None:
                _check_variable_arguments(name, self._words)
                self._names.append(name)
        self._words = []
        self._begun = False
        self._time_options = ()


def _check_assigned_name(name: str) -> None:
    """Refuse an assignment in the line to a name the environment deny policy refuses."""
    reason = denied_environment_name(name)
    if reason is not None:
        raise GuardRefusal(
            f"The line sets the environment variable {name!r}, which is not allowed with "
            f"allowed_commands: {reason}.",
            None,
            name,
        )


def _check_variable_arguments(name: str, words: list[_Word]) -> None:
    """Refuse a subscripted variable name handed to a builtin that takes variable names.

    `read 'a[$(cmd)]'`, `printf -v 'a[$(cmd)]' x` and `test -v 'a[$(cmd)]'` evaluate the
    subscript as arithmetic, and so run the command substitution written in single quotes.
    Only the literal words are seen: a name that an expansion produces is not.
    """
    if name in _EXPORTING_BUILTINS:
        for word in words[1:]:
            if not word.value.startswith("-"):
                _check_assigned_name(word.value.split("=", 1)[0].removesuffix("+"))
    if name not in _NAME_TAKING_BUILTINS:
        return
    option = _NAME_TAKING_BUILTINS[name]
    values = [word.value for word in words]
    start = values.index(name) + 1 if name in values else 1
    for position in range(start, len(values)):
        value = values[position]
        # For printf, test and wait only the operand of the option names a variable; for
        # the others any argument may (options included, conservatively).
        named = (
            option is None
            or values[position - 1] in option
            or any(value.startswith(flag) for flag in option)  # attached: -vNAME
        )
        if named and name in _ASSIGNING_BUILTINS and _IDENTIFIER.fullmatch(value):
            _check_assigned_name(value)  # `read PATH < f` sets PATH as `PATH=…` would
        if named and _SUBSCRIPTED_NAME.search(value):
            raise GuardRefusal(
                f"{name} evaluates the array subscript in {value!r} as arithmetic, which "
                "runs command substitutions, so the allowed_commands guard refuses it.",
                name,
            )


def _heredoc(delimiter: _Word, *, strip_tabs: bool) -> _Heredoc:
    quoted = any(c in delimiter.raw for c in "'\"\\")
    return _Heredoc(delimiter.value, strip_tabs, expands=not quoted)


def _expands(raw: str) -> bool:
    """Does the word hold `$` outside single quotes, or an unquoted glob or brace expansion?"""
    for index, quote in _live_characters(raw, in_heredoc=False):
        char = raw[index]
        if char == "$":
            return True
        if quote is None and (
            char in "*?"
            or (char == "[" and "]" in raw[index + 1 :])
            or (char == "{" and _BRACE_EXPANSION.match(raw, index) is not None)
        ):
            return True
    return False
