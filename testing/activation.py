"""Play systemd's part in socket activation: start a program with listening sockets passed as
fds 3, 4, … and LISTEN_PID / LISTEN_FDS / LISTEN_FDNAMES set for it.

LISTEN_PID must be the pid of the process that runs the program, which is known only after
fork, and the sockets must sit at exactly 3… when it execs. `subprocess` can do neither (its
`pass_fds` keeps fd numbers, its `env` is fixed before fork), hence fork + dup2 + execve.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Mapping, Sequence

import trio

SD_LISTEN_FDS_START = 3
EXEC_FAILED_STATUS = 127
WAIT_POLL_S = 0.01


def spawn_with_sockets(
    argv: Sequence[str],
    sockets: Sequence[socket.socket],
    names: Sequence[str],
    env: Mapping[str, str],
    *,
    stdout: int | None = None,
    stderr: int | None = None,
) -> int:
    """Fork; in the child, put `sockets` at fds 3… (in order), set the activation variables
    with LISTEN_PID = the child's own pid, and exec `argv` with `env`. Returns the child's pid
    (reap it with `wait_exit`). `stdout`/`stderr` are fds to give the child (default: ours).

    The parent keeps its sockets open; close them once the child has started if the child
    alone should hold them.
    """
    if len(names) != len(sockets):
        raise ValueError("one name per socket")
    if any(":" in name for name in names):
        raise ValueError("a name cannot contain ':' (the LISTEN_FDNAMES separator)")
    program = os.fsencode(argv[0])
    args = [os.fsencode(arg) for arg in argv]
    base_env = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    sources = [sock.fileno() for sock in sockets]
    stdio = [(1, stdout), (2, stderr)]
    # Above every fd involved, so parking the sources there cannot clobber one of them.
    park_floor = max([SD_LISTEN_FDS_START + len(sources), *sources, *(fd or 0 for _, fd in stdio)]) + 1

    pid = os.fork()
    if pid != 0:
        return pid
    try:
        # Park every source first: a source may already sit where another one must go.
        parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, park_floor) for fd in sources]
        parked_stdio = [
            (target, fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, park_floor))
            for target, fd in stdio
            if fd is not None
        ]
        for target, fd in parked_stdio:
            os.dup2(fd, target, inheritable=True)
        for index, fd in enumerate(parked):
            os.dup2(fd, SD_LISTEN_FDS_START + index, inheritable=True)
        child_env = dict(base_env)
        child_env[b"LISTEN_PID"] = str(os.getpid()).encode()
        child_env[b"LISTEN_FDS"] = str(len(parked)).encode()
        child_env[b"LISTEN_FDNAMES"] = ":".join(names).encode()
        os.execve(program, args, child_env)
    except BaseException as exc:  # never return into the parent's code in the child
        try:
            os.write(2, f"spawn_with_sockets: {exc!r}\n".encode())
        finally:
            os._exit(EXEC_FAILED_STATUS)
    raise AssertionError("unreachable")  # pragma: no cover


def exit_status(pid: int) -> int | None:
    """The child's exit code (negative: killed by that signal), None while it runs."""
    waited, status = os.waitpid(pid, os.WNOHANG)
    if waited == 0:
        return None
    return os.waitstatus_to_exitcode(status)


async def wait_exit(pid: int, timeout: float = 10.0) -> int:
    """Reap the child; its exit code (negative: killed by that signal)."""
    with trio.fail_after(timeout):
        while True:
            code = exit_status(pid)
            if code is not None:
                return code
            await trio.sleep(WAIT_POLL_S)


def listening_unix_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock


def listening_tcp_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock
