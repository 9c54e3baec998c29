"""The unix listener admits only the uids in `listen.unix_allowed_uids` (SO_PEERCRED).

The wire tests need root (CI runs as root) and the `nobody` user: a forked child switches to
nobody and connects to a real daemon's unix socket, whose mode is widened to 0666 after start
(as a socket unit with `SocketMode=0666` would have it), so only the uid check stands between
nobody and the control plane.
"""

from __future__ import annotations

import base64
import os
import pwd
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox_supervisor.daemon.config import MAX_UNIX_ALLOWED_UIDS, ConfigError, ListenConfig, load_config
from sandbox_supervisor.daemon.edge import server
from sandbox_supervisor.daemon.edge.server import FrontBudgets, FrontLimits
from sandbox_supervisor.testing.client import http_request
from sandbox_supervisor.testing.daemon import DaemonLayout, RunningDaemon, in_process_daemon, make_layout

OTHER_USER = "nobody"
CHILD_TIMEOUT_S = 10.0  # what the child waits for an answer; the tests' own deadlines are shorter
ANSWER_TIMEOUT_S = 5.0
# The child reports one of these, or the response's status line.
CLOSED = "closed"
TIMED_OUT = "timeout"


def _other_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        return None


needs_root_and_nobody = pytest.mark.skipif(
    os.geteuid() != 0 or _other_user() is None,
    reason="connecting as another uid needs root and a `nobody` user (CI runs as root on Debian)",
)


# --- configuration -------------------------------------------------------------------------


def test_the_default_is_the_daemons_uid_and_root():
    assert ListenConfig().unix_allowed_uids == sorted({os.geteuid(), 0})


@pytest.mark.parametrize(
    "value, problem",
    [
        ([], "at least one uid"),
        ([-1], "between 0 and"),
        ([2**32 - 1], "between 0 and"),  # (uid_t)-1 is "no uid", never a peer's
        ([True], "valid integer"),  # strict: no bool for an int
        (["0"], "valid integer"),
        (list(range(MAX_UNIX_ALLOWED_UIDS + 1)), "at most"),
    ],
)
def test_bad_uid_lists_are_configuration_errors(tmp_path, value, problem):
    with pytest.raises(ConfigError) as caught:
        load_config(None, env={}, overrides={
            "authority.issuer": "https://issuer.example",
            "authority.jwks_file": str(tmp_path / "jwks.json"),
            "listen.unix_allowed_uids": value,
        })
    [(key, message)] = caught.value.problems
    assert key.startswith("listen.unix_allowed_uids")
    assert problem in message


def test_uids_come_from_the_environment_sorted_and_deduplicated(tmp_path):
    config = load_config(None, env={
        "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://issuer.example",
        "SANDBOX_SUPERVISOR_AUTHORITY__JWKS_FILE": str(tmp_path / "jwks.json"),
        "SANDBOX_SUPERVISOR_LISTEN__UNIX_ALLOWED_UIDS": "[65534, 0, 65534]",
    })
    assert config.listen.unix_allowed_uids == [0, 65534]


def test_refused_peers_are_counted_under_peer_uid():
    budgets = FrontBudgets(
        FrontLimits(
            max_tcp_handshakes=1, max_unix_handshakes=1, max_handshakes_per_peer=1,
            unix_allowed_uids=frozenset({0, 1000}),
        )
    )
    assert budgets.admit_unix_peer(0) and budgets.admit_unix_peer(1000)
    assert not budgets.admit_unix_peer(65534)
    assert not budgets.admit_unix_peer(1001)
    assert budgets.refusals.drain() == {"peer_uid": 2}
    # Refused before a slot is taken: the unix pool is untouched.
    assert budgets.unix.in_use == 0


# --- over a real unix socket, as another uid ----------------------------------------------


def _exchange(path: str, request: bytes) -> bytes:
    """In the child: connect, send, and return the status line (or what happened)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CHILD_TIMEOUT_S)
    try:
        sock.connect(path)
        if request:
            sock.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n")[0] or CLOSED.encode()
    except (ConnectionResetError, BrokenPipeError):
        # The daemon closed with our request unread: the kernel reports a reset.
        return CLOSED.encode()
    except TimeoutError:
        return TIMED_OUT.encode()
    finally:
        sock.close()


async def connect_as(user: pwd.struct_passwd, path: Path, request: bytes) -> str:
    """Connect to `path` from a forked child running as `user` (so SO_PEERCRED names that
    uid), send `request`, and return the status line it got, CLOSED or TIMED_OUT."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain blocking stdlib calls only, then _exit
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(write_end, _exchange(str(path), request))
            status = 0
        except BaseException as exc:
            os.write(write_end, f"child failed: {exc!r}".encode())
        finally:
            os._exit(status)
    os.close(write_end)
    answer = b""
    try:
        with trio.fail_after(CHILD_TIMEOUT_S + ANSWER_TIMEOUT_S):
            async with trio.lowlevel.FdStream(read_end) as pipe:
                while chunk := await pipe.receive_some():
                    answer += chunk
    finally:
        await trio.to_thread.run_sync(os.waitpid, pid, 0)
    return answer.decode("latin-1")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user can traverse (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="peercred-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def peer_layout(root: Path, authority, **listen: object) -> DaemonLayout:
    return make_layout(root, authority=authority, listen={"unix": [str(root / "control.sock")], **listen})


def widen_socket(daemon: RunningDaemon) -> Path:
    assert daemon.unix.unix is not None
    path = Path(daemon.unix.unix)
    path.chmod(0o666)  # the file mode no longer keeps anyone out: only the uid check does
    return path


def upgrade_request(daemon: RunningDaemon, generation: int) -> bytes:
    """A complete, authorised upgrade head, as the control plane would send it."""
    client = daemon.client(daemon.unix)
    attempt = f"attempt-{uuid.uuid4()}"
    token = client.mint(generation=generation, attempt_id=attempt, ack_floor=0)
    headers = [
        ("host", daemon.unix.host_header),
        ("upgrade", "websocket"),
        ("connection", "Upgrade"),
        ("sec-websocket-key", base64.b64encode(os.urandom(16)).decode()),
        ("sec-websocket-version", "13"),
        *client.routing_headers(generation=generation, attempt_id=attempt, ack_floor=0, assertion=token),
    ]
    head = f"GET {client.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1")


class Recorder:
    """Stands in for the front's logger, whatever the process-wide log level filters."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def info(self, event: str, **fields: object) -> None:
        self.events.append({"event": event, **fields})

    exception = info


@needs_root_and_nobody
async def test_another_uid_is_closed_without_an_answer_and_root_upgrades(
    open_dir, authority, monkeypatch
):
    """An authorised upgrade from nobody is closed unanswered (never 101), and so are its
    health probe and an idle connection (at once: no slot is held, no first line awaited);
    root's upgrade and health on the same socket go through; the refusals are in the summary."""
    monkeypatch.setattr(server, "REFUSAL_SUMMARY_INTERVAL_S", 0.2)
    # An idle connection that were admitted would be held this long, not closed at once.
    monkeypatch.setattr(server, "FIRST_LINE_TIMEOUT_S", 30.0)
    recorder = Recorder()
    monkeypatch.setattr(server, "log", recorder)
    nobody = _other_user()
    assert nobody is not None
    async with in_process_daemon(peer_layout(open_dir, authority)) as daemon:
        path = widen_socket(daemon)
        with trio.fail_after(ANSWER_TIMEOUT_S):
            assert await connect_as(nobody, path, upgrade_request(daemon, 1)) == CLOSED
            health = f"GET /healthz HTTP/1.1\r\nhost: {daemon.unix.host_header}\r\n\r\n".encode()
            assert await connect_as(nobody, path, health) == CLOSED
            assert await connect_as(nobody, path, b"") == CLOSED

        # Root (this process) is admitted: health answers, and an upgrade completes (101).
        assert (await http_request(daemon.unix, "GET", "/healthz")).status == 200
        with trio.fail_after(ANSWER_TIMEOUT_S):
            async with daemon.client(daemon.unix).connect() as session:
                assert session.generation == 1

        def counted() -> int:
            return sum(e["counts"].get("peer_uid", 0) for e in recorder.events if e["event"] == "http.refused_summary")

        with trio.fail_after(ANSWER_TIMEOUT_S):
            while counted() < 3:
                await trio.sleep(0.05)
    assert counted() == 3
    first = [e for e in recorder.events if e["event"] == "http.refused"]
    assert first and first[0]["reason"] == "peer_uid" and first[0]["uid"] == nobody.pw_uid


@needs_root_and_nobody
async def test_a_uid_added_to_the_list_is_admitted(open_dir, authority):
    nobody = _other_user()
    assert nobody is not None
    layout = peer_layout(open_dir, authority, unix_allowed_uids=[0, nobody.pw_uid])
    async with in_process_daemon(layout) as daemon:
        path = widen_socket(daemon)
        with trio.fail_after(ANSWER_TIMEOUT_S):
            answer = await connect_as(nobody, path, upgrade_request(daemon, 1))
        assert answer.startswith("HTTP/1.1 101 ")


@needs_root_and_nobody
async def test_a_list_without_root_refuses_root(open_dir, authority):
    """The list is the whole set: root is admitted by default, not always."""
    nobody = _other_user()
    assert nobody is not None
    layout = peer_layout(open_dir, authority, unix_allowed_uids=[nobody.pw_uid])
    async with in_process_daemon(layout) as daemon:
        with trio.fail_after(ANSWER_TIMEOUT_S):
            stream = await daemon.unix.open_stream()
            try:
                await stream.send_all(f"GET /healthz HTTP/1.1\r\nhost: {daemon.unix.host_header}\r\n\r\n".encode())
                try:
                    answer = await stream.receive_some()
                except trio.BrokenResourceError:  # a reset: closed with our request unread
                    answer = b""
            finally:
                await stream.aclose()
        assert answer == b""
        with trio.fail_after(ANSWER_TIMEOUT_S):
            assert (await http_request(daemon.tcp, "GET", "/healthz")).status == 200
