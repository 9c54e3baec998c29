"""Socket activation (sd_listen_fds(3)): the parser and the wrapping in-process, the real
fork + dup2 + exec path with a child, and the daemon serving on inherited sockets.

In-process tests cannot move descriptors to 3…: pytest and trio own low fds. They dup2 real
sockets to a free block of high fds and pass its start as `first_fd`; the child tests run
the default path (fds at 3, LISTEN_PID = the child's pid) for real.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.edge.activation import (
    LISTEN_ENV,
    ActivationError,
    InheritedSocket,
    inherited_sockets,
    own_pidfd_inode_id,
    split_addresses,
    to_trio_listeners,
)
from sandbox_supervisor.testing.activation import (
    exit_status,
    listening_tcp_socket,
    listening_unix_socket,
    spawn_with_sockets,
    wait_exit,
)
from sandbox_supervisor.testing.client import Endpoint, http_request
from sandbox_supervisor.testing.daemon import LISTENING_FILE, make_layout

FREE_FD_SEARCH_START = 200
DAEMON_START_TIMEOUT_S = 20.0


def _fd_is_free(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as exc:
        return exc.errno == errno.EBADF
    return False


@contextmanager
def passed_at_high_fds(sockets: list[socket.socket]) -> Iterator[int]:
    """dup2 the sockets to consecutive free fds (without FD_CLOEXEC, as systemd passes them);
    yield the first; close whatever is still open afterwards."""
    start = FREE_FD_SEARCH_START
    while not all(_fd_is_free(fd) for fd in range(start, start + len(sockets))):
        start += 1
    for index, sock in enumerate(sockets):
        os.dup2(sock.fileno(), start + index, inheritable=True)
    try:
        yield start
    finally:
        for fd in range(start, start + len(sockets)):
            try:
                os.close(fd)
            except OSError:
                pass


def _env(pid: int, count: int, names: str | None = None, **extra: str) -> dict[str, str]:
    env = {"LISTEN_PID": str(pid), "LISTEN_FDS": str(count), "OTHER": "kept", **extra}
    if names is not None:
        env["LISTEN_FDNAMES"] = names
    return env


def _assert_unset(env: dict[str, str]) -> None:
    assert not any(name in env for name in LISTEN_ENV)
    assert env.get("OTHER") == "kept"  # only the activation variables go


# --- the parser ---------------------------------------------------------------------------


def test_no_listen_pid_means_nothing_was_passed() -> None:
    env = {"LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b", "OTHER": "kept"}
    assert inherited_sockets(env, pid=os.getpid()) == []
    _assert_unset(env)


def test_variables_for_another_process_are_ignored_and_unset() -> None:
    # Inherited from a parent that was the real target: its fds 3… are not ours to touch.
    env = _env(os.getpid() + 1, 2, "a:b")
    assert inherited_sockets(env, pid=os.getpid()) == []
    _assert_unset(env)


def test_listen_pid_without_listen_fds_is_nothing() -> None:
    env = {"LISTEN_PID": str(os.getpid())}
    assert inherited_sockets(env, pid=os.getpid()) == []
    assert env == {}


@pytest.mark.parametrize(
    "variables",
    [
        {"LISTEN_PID": "abc", "LISTEN_FDS": "1"},
        {"LISTEN_PID": "0", "LISTEN_FDS": "1"},
        {"LISTEN_PID": "-1", "LISTEN_FDS": "1"},
        {"LISTEN_PID": "+{pid}", "LISTEN_FDS": "1"},
        {"LISTEN_PID": "{pid}", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "{pid}", "LISTEN_FDS": "-1"},
        {"LISTEN_PID": "{pid}", "LISTEN_FDS": " 1"},
        {"LISTEN_PID": "{pid}", "LISTEN_FDS": "x"},
        {"LISTEN_PID": "{pid}", "LISTEN_FDS": "1", "LISTEN_PIDFDID": "nope"},
    ],
)
def test_malformed_variables_are_errors_and_still_unset(variables: dict[str, str]) -> None:
    env = {key: value.format(pid=os.getpid()) for key, value in variables.items()}
    with pytest.raises(ActivationError):
        inherited_sockets(env, pid=os.getpid(), first_fd=FREE_FD_SEARCH_START)
    assert env == {}


def test_a_passed_fd_that_is_not_open_is_an_error() -> None:
    start = FREE_FD_SEARCH_START
    while not _fd_is_free(start):
        start += 1
    env = _env(os.getpid(), 1)
    with pytest.raises(ActivationError, match="not open"):
        inherited_sockets(env, pid=os.getpid(), first_fd=start)
    _assert_unset(env)


def test_a_passed_fd_that_is_not_a_socket_is_an_error() -> None:
    read_end, write_end = os.pipe()
    start = FREE_FD_SEARCH_START
    while not _fd_is_free(start):
        start += 1
    os.dup2(read_end, start)
    try:
        env = _env(os.getpid(), 1)
        with pytest.raises(ActivationError, match="not a socket"):
            inherited_sockets(env, pid=os.getpid(), first_fd=start)
        _assert_unset(env)
    finally:
        for fd in (start, read_end, write_end):
            os.close(fd)


# --- describing and wrapping real sockets -----------------------------------------------


def test_describes_sockets_sets_cloexec_and_unsets(tmp_path: Path) -> None:
    unix = listening_unix_socket(str(tmp_path / "a.sock"))
    tcp = listening_tcp_socket()
    try:
        with passed_at_high_fds([unix, tcp]) as start:
            assert not fcntl.fcntl(start, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            env = _env(os.getpid(), 2, "control-unix:control-tcp")
            found = inherited_sockets(env, pid=os.getpid(), first_fd=start)
            assert found == [
                InheritedSocket(start, socket.AF_UNIX, "control-unix", str(tmp_path / "a.sock")),
                InheritedSocket(
                    start + 1, socket.AF_INET, "control-tcp", f"127.0.0.1:{tcp.getsockname()[1]}"
                ),
            ]
            for fd in (start, start + 1):
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "children must not inherit"
                os.fstat(fd)  # describing did not close it
            _assert_unset(env)
            assert split_addresses(found) == (
                [f"127.0.0.1:{tcp.getsockname()[1]}"],
                [str(tmp_path / "a.sock")],
            )
    finally:
        unix.close()
        tcp.close()


def test_names_default_to_unknown_and_keep_empty_entries(tmp_path: Path) -> None:
    sockets = [listening_tcp_socket() for _ in range(3)]
    try:
        with passed_at_high_fds(sockets) as start:
            unnamed = inherited_sockets(_env(os.getpid(), 3), pid=os.getpid(), first_fd=start)
            assert [s.name for s in unnamed] == ["unknown"] * 3
            named = inherited_sockets(_env(os.getpid(), 3, "a::c"), pid=os.getpid(), first_fd=start)
            assert [s.name for s in named] == ["a", "", "c"]
    finally:
        for sock in sockets:
            sock.close()


def test_a_name_count_that_differs_from_the_fd_count_is_an_error() -> None:
    sockets = [listening_tcp_socket() for _ in range(2)]
    try:
        with passed_at_high_fds(sockets) as start:
            for names in ("only-one", "a:b:c", ""):
                env = _env(os.getpid(), 2, names)
                with pytest.raises(ActivationError, match="LISTEN_FDNAMES"):
                    inherited_sockets(env, pid=os.getpid(), first_fd=start)
                _assert_unset(env)
    finally:
        for sock in sockets:
            sock.close()


def test_listen_pidfdid_must_name_our_own_pidfd_where_the_kernel_has_pidfs() -> None:
    sock = listening_tcp_socket()
    try:
        with passed_at_high_fds([sock]) as start:
            own = own_pidfd_inode_id()
            other = _env(os.getpid(), 1, LISTEN_PIDFDID=str((own or 0) + 1))
            found = inherited_sockets(other, pid=os.getpid(), first_fd=start)
            if own is None:
                # No pidfs: the id cannot be checked, so libsystemd (and we) ignore it.
                assert len(found) == 1
            else:
                assert found == []  # for the process whose pidfd has that id, not us
                mine = _env(os.getpid(), 1, LISTEN_PIDFDID=str(own))
                assert len(inherited_sockets(mine, pid=os.getpid(), first_fd=start)) == 1
    finally:
        sock.close()


async def test_wrapped_listeners_accept_connections(tmp_path: Path) -> None:
    path = str(tmp_path / "served.sock")
    unix = listening_unix_socket(path)
    tcp = listening_tcp_socket()
    port = tcp.getsockname()[1]
    try:
        with passed_at_high_fds([unix, tcp]) as start:
            found = inherited_sockets(_env(os.getpid(), 2), pid=os.getpid(), first_fd=start)
            listeners = to_trio_listeners(found)
            assert [listener.socket.fileno() for listener in listeners] == [start, start + 1]

            async def echo_once(listener: trio.SocketListener) -> None:
                stream = await listener.accept()
                async with stream:
                    await stream.send_all(b"echo:" + await stream.receive_some(100))

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for listener in listeners:
                        nursery.start_soon(echo_once, listener)
                    for endpoint in (Endpoint(unix=path), Endpoint(tcp=("127.0.0.1", port))):
                        stream = await endpoint.open_stream()
                        async with stream:
                            await stream.send_all(b"hi")
                            assert await stream.receive_some(100) == b"echo:hi"
            for listener in listeners:
                await listener.aclose()  # the listeners own the fds now
            assert all(_fd_is_free(fd) for fd in (start, start + 1))
    finally:
        unix.close()
        tcp.close()


def test_only_listening_stream_sockets_are_wrapped(tmp_path: Path) -> None:
    datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    datagram.bind(("127.0.0.1", 0))
    bound_only = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    bound_only.bind(("127.0.0.1", 0))
    good = listening_tcp_socket()
    try:
        for bad, reason in ((datagram, "not a stream socket"), (bound_only, "not listening")):
            with passed_at_high_fds([good, bad]) as start:
                found = inherited_sockets(_env(os.getpid(), 2), pid=os.getpid(), first_fd=start)
                with pytest.raises(ActivationError, match=reason):
                    to_trio_listeners(found)
                # Refused before taking ownership of any: both fds are still open.
                os.fstat(start)
                os.fstat(start + 1)
    finally:
        for sock in (datagram, bound_only, good):
            sock.close()


def test_other_families_are_refused(tmp_path: Path) -> None:
    weird = InheritedSocket(fd=0, family=socket.AF_NETLINK, name="x", address="")
    with pytest.raises(ActivationError, match="not TCP or unix"):
        to_trio_listeners([weird])


# --- as systemd does it: fork, fds at 3…, LISTEN_PID = the child's pid, exec -------------

CHILD_REPORT = """
import fcntl, json, os, subprocess, sys
from sandbox_supervisor.daemon.edge.activation import inherited_sockets
found = inherited_sockets()
grandchild_env = subprocess.run(
    [sys.executable, "-c", "import os, json; print(json.dumps(sorted(k for k in os.environ if k.startswith('LISTEN_'))))"],
    capture_output=True, text=True, check=True,
).stdout
print(json.dumps({
    "pid": os.getpid(),
    "sockets": [[s.fd, int(s.family), s.name, s.address] for s in found],
    "cloexec": [bool(fcntl.fcntl(s.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for s in found],
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    "grandchild_env": json.loads(grandchild_env),
}))
"""


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}


async def test_a_child_started_as_systemd_does_finds_its_sockets(tmp_path: Path) -> None:
    unix = listening_unix_socket(str(tmp_path / "c.sock"))
    tcp = listening_tcp_socket()
    port = tcp.getsockname()[1]
    read_end, write_end = os.pipe()
    try:
        pid = spawn_with_sockets(
            [sys.executable, "-c", CHILD_REPORT],
            [unix, tcp],
            ["control-unix", "control-tcp"],
            _child_env(),
            stdout=write_end,
        )
        os.close(write_end)
        write_end = -1
        assert await wait_exit(pid, timeout=30) == 0
        with os.fdopen(read_end, "r") as out:
            read_end = -1
            report = json.loads(out.read())
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        unix.close()
        tcp.close()
    assert report["pid"] == pid
    assert report["sockets"] == [
        [3, socket.AF_UNIX, "control-unix", str(tmp_path / "c.sock")],
        [4, socket.AF_INET, "control-tcp", f"127.0.0.1:{port}"],
    ]
    assert report["cloexec"] == [True, True]
    assert report["env_left"] == []
    assert report["grandchild_env"] == []


def test_a_child_that_merely_inherits_the_variables_ignores_them(tmp_path: Path) -> None:
    # LISTEN_PID names our pid, not the child's: the child must not treat its fds as passed.
    env = {**_child_env(), "LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", "from sandbox_supervisor.daemon.edge.activation import inherited_sockets as f; "
         "import os; print(f(), sorted(k for k in os.environ if k.startswith('LISTEN_')))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[] []"


# --- the daemon on inherited sockets ------------------------------------------------------
# Needs the daemon's integration of supervisor.activation (app.py) and a configuration whose
# listen lists may be empty when sockets are passed in.


async def _wait_healthy(endpoint: Endpoint, pid: int, log_path: Path) -> dict:
    with trio.fail_after(DAEMON_START_TIMEOUT_S):
        while True:
            code = exit_status(pid)
            if code is not None:
                raise AssertionError(
                    f"daemon exited with {code} before serving:\n{log_path.read_text(errors='replace')}"
                )
            try:
                response = await http_request(endpoint, "GET", "/healthz", timeout=2)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError):
                await trio.sleep(0.05)
                continue
            assert response.status == 200, response.body
            return response.json()


async def test_daemon_serves_on_sockets_passed_by_systemd(tmp_path: Path, authority) -> None:
    layout = make_layout(
        tmp_path / "daemon",
        authority=authority,
        listen={"tcp": [], "unix": []},  # everything it serves comes from systemd
        websocket={"handshake_timeout_s": 2.0, "drain_budget_s": 0.5},
    )
    config_file = layout.write_config()
    unix_path = tmp_path / "activated.sock"
    unix = listening_unix_socket(str(unix_path))
    tcp = listening_tcp_socket()
    port = tcp.getsockname()[1]
    log_path = tmp_path / "daemon.log"
    env = {
        k: v
        for k, v in _child_env().items()
        if not k.startswith("SANDBOX_SUPERVISOR_") and k != "NOTIFY_SOCKET"
    }
    with open(log_path, "wb") as log:
        pid = spawn_with_sockets(
            [sys.executable, "-m", "sandbox_supervisor.daemon", "serve", "--config", str(config_file)],
            [unix, tcp],
            ["control-unix", "control-tcp"],
            env,
            stdout=log.fileno(),
            stderr=log.fileno(),
        )
    # Only the daemon holds the sockets now: whatever answers is the daemon.
    unix.close()
    tcp.close()
    try:
        for endpoint in (Endpoint(unix=str(unix_path)), Endpoint(tcp=("127.0.0.1", port))):
            health = await _wait_healthy(endpoint, pid, log_path)
            assert health["status"] == "ok"
        listening = json.loads((layout.state_dir / LISTENING_FILE).read_text())
        assert listening == {"tcp": [f"127.0.0.1:{port}"], "unix": [str(unix_path)]}
        os.kill(pid, signal.SIGTERM)
        assert await wait_exit(pid, timeout=15) == 0, log_path.read_text(errors="replace")
    finally:
        try:
            still_running = exit_status(pid) is None
        except ChildProcessError:  # already reaped
            still_running = False
        if still_running:
            os.kill(pid, signal.SIGKILL)
            await wait_exit(pid)
    # systemd owns an inherited socket: the daemon must leave its path in place.
    assert unix_path.exists()
