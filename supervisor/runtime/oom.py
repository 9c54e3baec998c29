"""OOM-killer preference: protect the daemon, not the agent's commands.

The unit lowers the daemon's oom_score_adj (OOMScoreAdjust=, SUPERVISOR_OOM_SCORE_ADJ); every
child inherits that value at fork, so without a correction a runaway test suite the agent
started would be shielded too, and the kernel would kill something else first. Commands
therefore raise their own value to COMMAND_OOM_SCORE_ADJ before they exec the agent's command,
the way E2B's envd does for the processes it starts: set in the child, before exec, so no
grandchild can be forked with the protected value in between.

Raising one's own oom_score_adj needs no privilege. (Lowering it again down to the inherited
minimum is also allowed, so this keeps accidents off the daemon; it is not a defence against
an agent set on protecting its own processes.)
"""

from __future__ import annotations

from collections.abc import Sequence

# systemd/sandbox-supervisor.service OOMScoreAdjust= (a test keeps the two equal). Not -1000:
# a daemon leaking memory itself must stay killable, and systemd restarts it.
SUPERVISOR_OOM_SCORE_ADJ = -900
# What E2B's envd gives the commands it starts: a command started through the supervisor and
# one started through E2B's own API are equal candidates, both preferred over the sandbox's
# services (0) and far more than the daemon.
COMMAND_OOM_SCORE_ADJ = 100
OOM_SCORE_ADJ_MIN = -1000
OOM_SCORE_ADJ_MAX = 1000
WRAPPER_SHELL = "/bin/sh"
OOM_SCORE_ADJ_FILE = "/proc/self/oom_score_adj"


# Exit status of a gated wrapper whose gate closed without the go-ahead (the daemon could not
# place it in its cgroup, or died): the command never ran. 125: not a status the shell gives
# a command of its own (126/127: not executable/not found).
GATE_CLOSED_EXIT = 125
GATE_GO = b"\n"


def _wrapper_script(target: str, gated: bool = False) -> str:
    # $0 is the value; the rest is the command to exec. The write is best effort (a kernel
    # without the file, or a value the kernel refuses, must not stop the command) and silent:
    # stderr is redirected *before* the file is opened, since a shell reports a failed open
    # on the stderr it has at that moment. The `exec` keeps the pid, so the process (group)
    # the daemon started is the command itself.
    #
    # Gated: stdin is the gate, a pipe from the daemon. `read` waits for the go-ahead line the
    # daemon writes once the pid is in the command's cgroup(s) (the wrapper already runs as
    # the command user and could not write root's cgroup.procs itself); EOF without it means
    # "do not run". The command then gets /dev/null as stdin, as without a gate. (dash's read
    # takes a pipe one byte at a time, so nothing past the line is consumed.)
    if gated:
        return f'echo "$0" 2>/dev/null >{target}; read -r gate || exit {GATE_CLOSED_EXIT}; exec "$@" </dev/null'
    return f'echo "$0" 2>/dev/null >{target}; exec "$@"'


_WRAPPER_SCRIPT = _wrapper_script(OOM_SCORE_ADJ_FILE)
_GATED_WRAPPER_SCRIPT = _wrapper_script(OOM_SCORE_ADJ_FILE, gated=True)


def with_oom_score_adj(argv: Sequence[str], value: int = COMMAND_OOM_SCORE_ADJ, *, gated: bool = False) -> list[str]:
    """`argv` prefixed so that the process sets its oom_score_adj to `value`, then execs argv.
    `gated`: it waits on stdin for the daemon's go-ahead (GATE_GO) before the exec, and the
    command runs with /dev/null as stdin (see `_wrapper_script`).

    Costs one exec of /bin/sh (0.5-0.6 ms with dash). The alternative without it, writing
    /proc/<pid>/oom_score_adj from the daemon after spawn, leaves a window in which the
    command can fork children that keep the daemon's protection; a `cat` in the first line
    of a command wins that race often enough to fail a test on a loaded machine.
    """
    if not OOM_SCORE_ADJ_MIN <= value <= OOM_SCORE_ADJ_MAX:
        raise ValueError(f"oom_score_adj must be {OOM_SCORE_ADJ_MIN}..{OOM_SCORE_ADJ_MAX}")
    if not argv:
        raise ValueError("argv must name a program")
    return [WRAPPER_SHELL, "-c", _GATED_WRAPPER_SCRIPT if gated else _WRAPPER_SCRIPT, str(value), *argv]


def read_oom_score_adj(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/oom_score_adj") as handle:
        return int(handle.read().strip())
