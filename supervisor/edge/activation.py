"""Socket activation: the listening sockets systemd passes in, as sd_listen_fds(3) reads them.

The rules, as libsystemd applies them (sd_listen_fds, sd_listen_fds_with_names):
- LISTEN_PID absent, or not our pid: nothing was passed to *us* (the variables may have been
  inherited from a parent), so there are no sockets; a malformed LISTEN_PID is an error.
- LISTEN_PIDFDID, when present, must also be the inode id of a pidfd for our own process
  (systemd 257+, where the kernel has pidfs); another id means "not for us".
- LISTEN_FDS counts the descriptors; they are numbered from SD_LISTEN_FDS_START (3). Absent
  means none; anything but a positive decimal integer is an error.
- Every passed descriptor gets FD_CLOEXEC, so the agent's commands never inherit a listener.
- LISTEN_FDNAMES, when present, is one name per descriptor separated by ":" (empty names
  kept); a different count is an error. Absent, every name is "unknown".
- The variables are removed from the environment in every case, so no child sees them.

`inherited_sockets` does the above and describes each descriptor; `to_trio_listeners` checks
that each one is a listening stream socket the daemon can serve on and wraps it for trio;
`open_daemon_listeners` is what the daemon calls: the passed sockets when there are any (the
configured listen lists are then ignored: systemd owns the addresses), else the configured ones.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

import structlog
import trio
from structlog.typing import FilteringBoundLogger

from sandbox_supervisor.daemon.edge.server import BoundListeners, open_listeners

log: FilteringBoundLogger = structlog.get_logger("supervisor.activation")

SD_LISTEN_FDS_START = 3
LISTEN_PID_ENV = "LISTEN_PID"
LISTEN_PIDFDID_ENV = "LISTEN_PIDFDID"
LISTEN_FDS_ENV = "LISTEN_FDS"
LISTEN_FDNAMES_ENV = "LISTEN_FDNAMES"
LISTEN_ENV = (LISTEN_PID_ENV, LISTEN_PIDFDID_ENV, LISTEN_FDS_ENV, LISTEN_FDNAMES_ENV)
FDNAMES_SEPARATOR = ":"
UNKNOWN_NAME = "unknown"  # libsystemd's name for every fd when LISTEN_FDNAMES is absent
# sd_listen_fds refuses counts that would overflow an int past the start fd.
MAX_LISTEN_FDS = 2**31 - 1 - SD_LISTEN_FDS_START
SERVABLE_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)


class ActivationError(Exception):
    """The activation variables or the passed descriptors are unusable (a start-up error)."""


@dataclass(frozen=True, slots=True)
class InheritedSocket:
    fd: int
    family: socket.AddressFamily
    name: str
    # "host:port" ("[v6]:port") for TCP, the path for a unix socket ("@name" when abstract,
    # "" when unnamed).
    address: str


def inherited_sockets(
    env: MutableMapping[str, str] = os.environ,
    pid: int | None = None,
    *,
    first_fd: int = SD_LISTEN_FDS_START,
) -> list[InheritedSocket]:
    """The sockets passed to this process, [] when none were. Raises ActivationError.

    `env` loses the LISTEN_* variables whatever the outcome (pass os.environ, the default, so
    that they are really unset for children). `first_fd` exists for tests, which cannot move
    descriptors to 3 inside a running test process; systemd always starts at 3.
    """
    try:
        names = _listen_names(env.get(LISTEN_FDNAMES_ENV))
        count = _listen_count(env, os.getpid() if pid is None else pid)
        if count == 0:
            return []
        if names is None:
            names = [UNKNOWN_NAME] * count
        elif len(names) != count:
            raise ActivationError(
                f"{LISTEN_FDNAMES_ENV} has {len(names)} names for {LISTEN_FDS_ENV}={count}"
            )
        fds = range(first_fd, first_fd + count)
        for fd in fds:
            _set_cloexec(fd)
        return [_describe(fd, name) for fd, name in zip(fds, names, strict=True)]
    finally:
        for name in LISTEN_ENV:
            env.pop(name, None)


def _listen_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    # libsystemd splits without coalescing ("a::b" is three names); "" is no names at all.
    return text.split(FDNAMES_SEPARATOR) if text else []


def _listen_count(env: MutableMapping[str, str], pid: int) -> int:
    pid_text = env.get(LISTEN_PID_ENV)
    if pid_text is None:
        return 0
    listen_pid = _decimal(pid_text)
    if listen_pid is None or listen_pid == 0:
        raise ActivationError(f"{LISTEN_PID_ENV}={pid_text!r} is not a pid")
    if listen_pid != pid:
        return 0  # meant for another process (we inherited its environment)
    pidfd_text = env.get(LISTEN_PIDFDID_ENV)
    if pidfd_text is not None:
        pidfd_id = _decimal(pidfd_text)
        if pidfd_id is None:
            raise ActivationError(f"{LISTEN_PIDFDID_ENV}={pidfd_text!r} is not a number")
        own = own_pidfd_inode_id() if pid == os.getpid() else None
        if own is not None and own != pidfd_id:
            return 0
    count_text = env.get(LISTEN_FDS_ENV)
    if count_text is None:
        return 0
    count = _decimal(count_text)
    if count is None or not 0 < count <= MAX_LISTEN_FDS:
        raise ActivationError(f"{LISTEN_FDS_ENV}={count_text!r} is not a positive count")
    return count


def own_pidfd_inode_id() -> int | None:
    """The inode id of a pidfd for this process where the kernel has pidfs, else None.

    With pidfs (Linux 6.9+) every process's pidfd has its own inode; before it, every pidfd
    shares the one anonymous inode, so the id means nothing and libsystemd skips the check.
    Comparing with a pidfd of another process (pid 1, or our parent) tells the two apart.
    """
    try:
        own = _pidfd_inode(os.getpid())
    except OSError:
        return None
    for other_pid in (1, os.getppid()):
        try:
            other = _pidfd_inode(other_pid)
        except OSError:
            continue
        return own if other != own else None
    return None


def _pidfd_inode(pid: int) -> int:
    fd = os.pidfd_open(pid)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _decimal(text: str) -> int | None:
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def _set_cloexec(fd: int) -> None:
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
    except OSError as exc:
        raise ActivationError(f"passed fd {fd} is not open: {exc.strerror}") from None


def _describe(fd: int, name: str) -> InheritedSocket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"passed fd {fd} ({name}) is not a socket: {exc.strerror}") from None
    try:
        family = sock.family
        address = format_address(family, sock.getsockname())
    finally:
        sock.detach()  # describing must not take ownership of (or close) the descriptor
    return InheritedSocket(fd=fd, family=family, name=name, address=address)


def format_address(family: int, sockname: object) -> str:
    # getsockname() gives (host, port, ...) for the inet families, a str or bytes for unix.
    if family in (socket.AF_INET, socket.AF_INET6) and isinstance(sockname, tuple):
        host, port = sockname[0], sockname[1]
        return f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
    if family == socket.AF_UNIX:
        path = os.fsdecode(sockname) if isinstance(sockname, bytes) else str(sockname)
        return "@" + path[1:] if path.startswith("\0") else path
    return str(sockname)


def to_trio_listeners(sockets: Iterable[InheritedSocket]) -> list[trio.SocketListener]:
    """Trio listeners owning the inherited descriptors. Raises ActivationError, before taking
    ownership of any, when one is not a listening SOCK_STREAM socket of a servable family."""
    checked = list(sockets)
    for inherited in checked:
        _check_servable(inherited)
    listeners = []
    for inherited in checked:
        # socket.socket(fileno=...) reads family, type and protocol from the descriptor;
        # trio makes it non-blocking.
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=inherited.fd))
        listeners.append(trio.SocketListener(sock))
    return listeners


def _check_servable(inherited: InheritedSocket) -> None:
    label = f"passed fd {inherited.fd} ({inherited.name}, {inherited.address or 'unnamed'})"
    if inherited.family not in SERVABLE_FAMILIES:
        raise ActivationError(f"{label} is {inherited.family!r}, not TCP or unix")
    probe = socket.socket(fileno=inherited.fd)
    try:
        sock_type = probe.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        accepting = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError as exc:
        raise ActivationError(f"{label}: {exc.strerror}") from None
    finally:
        probe.detach()
    if sock_type != socket.SOCK_STREAM:
        raise ActivationError(f"{label} is not a stream socket (ListenStream=)")
    if not accepting:
        raise ActivationError(f"{label} is not listening (Accept=no is required)")


def split_addresses(sockets: Iterable[InheritedSocket]) -> tuple[list[str], list[str]]:
    """(tcp, unix) addresses, for the log and listening.json."""
    tcp: list[str] = []
    unix: list[str] = []
    for inherited in sockets:
        (unix if inherited.family == socket.AF_UNIX else tcp).append(inherited.address)
    return tcp, unix


async def open_daemon_listeners(
    tcp: list[str],
    unix: list[str],
    env: MutableMapping[str, str] = os.environ,
) -> tuple[BoundListeners, list[str]]:
    """The daemon's listeners, and the unix socket paths it created itself.

    Sockets passed by systemd win over the configuration (which may then list none); the
    daemon must never unlink those paths, since the socket unit owns them and outlives the
    daemon, so only the second value is to be removed at exit. Raises ActivationError for
    unusable activation variables or sockets, and when there is nothing to listen on at all.
    """
    inherited = inherited_sockets(env)
    if inherited:
        inherited_tcp, inherited_unix = split_addresses(inherited)
        listeners = to_trio_listeners(inherited)
        log.info(
            "listeners.inherited",
            names=[s.name for s in inherited],
            tcp=inherited_tcp,
            unix=inherited_unix,
            configured_ignored=bool(tcp or unix),
        )
        return BoundListeners(listeners, inherited_tcp, inherited_unix), []
    if not tcp and not unix:
        raise ActivationError(
            "listen: no tcp or unix listener is configured and systemd passed no sockets"
        )
    bound = await open_listeners(tcp, unix)
    return bound, list(bound.unix)
