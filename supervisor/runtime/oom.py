"""OOM-killer preference: protect the daemon, not the agent's commands.

The unit lowers the daemon's oom_score_adj (OOMScoreAdjust=, SUPERVISOR_OOM_SCORE_ADJ); every
child inherits that value at fork, so without a correction a runaway test suite the agent
started would be shielded too, and the kernel would kill something else first. Commands
therefore raise their own value to COMMAND_OOM_SCORE_ADJ before they exec the agent's command,
the way E2B's envd does for the processes it starts, before exec, so no grandchild can be
forked with the protected value in between (HolderSpec.oom_score_adj). The command host and
the holders of the fork server do it without code in the child (`spawner.Spawner`): each sets
the command's value on itself around the spawn, so the child inherits it at fork, and
restores its own right after: lowering it back to the value it inherited is allowed (below).
Where that spawn cannot be used (a terminal; a holder started by `launch_holder`) the child
of `holder.spawn` writes the value itself (`holder._child`).

Raising one's own oom_score_adj needs no privilege. (Lowering it again down to the inherited
minimum is also allowed, so this keeps accidents off the daemon; it is not a defence against
an agent set on protecting its own processes.)
"""

from __future__ import annotations


# systemd/sandbox-supervisor.service OOMScoreAdjust= (a test keeps the two equal). Not -1000:
# a daemon leaking memory itself must stay killable, and systemd restarts it.
SUPERVISOR_OOM_SCORE_ADJ = -900
# What E2B's envd gives the commands it starts: a command started through the supervisor and
# one started through E2B's own API are equal candidates, both preferred over the sandbox's
# services (0) and far more than the daemon.
COMMAND_OOM_SCORE_ADJ = 100
OOM_SCORE_ADJ_MIN = -1000
OOM_SCORE_ADJ_MAX = 1000
OOM_SCORE_ADJ_FILE = "/proc/self/oom_score_adj"


def read_oom_score_adj(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/oom_score_adj") as handle:
        return int(handle.read().strip())
