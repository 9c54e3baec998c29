"""The daemon's side of the command host (command_host.py), from trio.

`CommandHost.spawn(call_id, directory, spec)` starts a command through the host and returns a
`HostedProcess`: what `ProcessGroup` needs of a process (pid, Popen-style return code, wait,
the stdout and stderr pipes), with the exit status coming from the host, which is the
command's parent. `done(call_id)` tells the host the call completed (it forgets the command
and will not record its exit). The host is started on the first spawn and again after it
died; a host that does not answer a spawn within SPAWN_TIMEOUT_S is killed.

If the host dies, the commands it had spawned lose their parent: their exit statuses are
gone. Each `HostedProcess.wait()` then raises `HostLost`, and the shell reports the call
interrupted (what a kill of the host means for a call, like a kill of a held process's
holder; with a command user the agent's code cannot kill the host).
"""

from __future__ import annotations

import array
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import trio

from sandbox_supervisor.daemon import fd_wait
from sandbox_supervisor.daemon.runtime.command_host import HOST_SPEC_FILE, MAX_MESSAGE_BYTES
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec

log = structlog.get_logger("supervisor.shell")

HOST_MODULE = "sandbox_supervisor.daemon.runtime.command_host"
# A spawn is a fork and an exec in a small process: milliseconds. Past this the host is
# taken for wedged, killed, and the spawn fails.
SPAWN_TIMEOUT_S = 10.0
# Larger spawn requests send their spec by file (HOST_SPEC_FILE): well under any kernel's
# datagram limit for this socket.
INLINE_SPEC_MAX_BYTES = 64 * 1024
# How long a stop waits for a host without commands to exit (it exits as the socket closes).
HOST_EXIT_WAIT_S = 1.0
# Two descriptors (stdout, stderr) per `spawned` message.
_FDS_PER_SPAWN = 2
_ANCILLARY_BYTES = socket.CMSG_SPACE(_FDS_PER_SPAWN * array.array("i").itemsize)


class HostLost(Exception):
    """The command host ended while the command ran: its exit status is unknown."""


class SpawnFailed(OSError):
    """The host could not start the command: the OSError of the failing `stage` (stdio,
    fork, setsid, cgroup, cwd, identity, exec; `spec` with errno 0 for a spec it refused)."""

    def __init__(self, stage: str, code: int, message: str) -> None:
        super().__init__(code, os.strerror(code) if code else message)
        self.stage = stage


class HostedProcess:
    """A command the host spawned, as ProcessGroup sees a process."""

    def __init__(
        self,
        host: CommandHost,
        pid: int,
        start_ticks: int,
        stdout: trio.lowlevel.FdStream,
        stderr: trio.lowlevel.FdStream,
    ) -> None:
        self._host = host
        self.pid = pid
        self.start_ticks = start_ticks
        self.stdout: trio.lowlevel.FdStream | None = stdout
        self.stderr: trio.lowlevel.FdStream | None = stderr
        self.returncode: int | None = None  # Popen-style: negative when a signal ended it
        self.exited = trio.Event()  # its end (or the host's) is known

    async def wait(self) -> int:
        """Its return code; HostLost when the host ended before it reported the exit."""
        await self._host.receive_until(self.exited.is_set)
        if self.returncode is None:
            raise HostLost()
        return self.returncode

    def _set_status(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        self.exited.set()


class CommandHost:
    """The link to the command host. It has no task of its own: whoever waits for an answer
    (a spawn, an exit) reads the socket while it waits, one reader at a time, and hands on
    what it reads for others. So nothing keeps a nursery open once the commands are done, and
    the host's messages wait in the socket's buffer while nobody waits for them."""

    def __init__(self, idle_shells: int = 0) -> None:
        # `[exec] idle_shells`: how many pre-started shells the host keeps (command_host.ShellPool).
        self.idle_shells = idle_shells
        self._lock = trio.Lock()  # one spawn at a time: the next answer is its own
        self._socket: trio.socket.SocketType | None = None
        self._raw: socket.socket | None = None
        self._process: trio.Process | None = None
        self._processes: dict[str, HostedProcess] = {}
        self._reply: dict[str, Any] | None = None
        self._reading = False
        self._dispatched = trio.Event()  # set (and replaced) each time the reader stops
        self._unsent: list[bytes] = []  # `done` messages the socket had no room for yet
        self.closed = False

    # --- spawning ------------------------------------------------------------------------

    async def spawn(
        self, call_id: str, directory: Path, spec: HolderSpec, place: Sequence[Sequence[str]] = ()
    ) -> HostedProcess:
        """Start `spec` (stdin /dev/null, no terminal) for `call_id`; SpawnFailed when it did
        not start, OSError when the host itself cannot be started or reached. `place`:
        cgroups (each its directories, the membership first) the host's next idle shells are
        to wait in (ready_cgroups.py)."""
        request = self._request(call_id, directory, place)
        message = json.dumps({**request, "spec": spec.to_json()}).encode()
        # Shielded, with its own deadline: cut off between the request and the answer, a
        # spawn would leave a command running that nobody tends. Nothing awaits before the
        # lock, which is FIFO: requests reach the host in the order their callers took their
        # cgroups (ready_cgroups.py), so no offer of a cgroup arrives after its call.
        with trio.CancelScope(shield=True):
            try:
                # A free lock is taken without a checkpoint (the usual case: one spawn at a
                # time), as a waiter's turn would be: `async with` yields even then, one
                # more pass of the event loop on every command's way. Free means nobody
                # waits (a release hands the lock to the first waiter), so the order holds.
                self._lock.acquire_nowait()
            except trio.WouldBlock:
                await self._lock.acquire()
            try:
                if len(message) > INLINE_SPEC_MAX_BYTES:
                    # A datagram must fit the socket's send buffer (2 × net.core.wmem_max: 416
                    # KiB on a stock kernel); a large environment goes by file, in the call's
                    # private spool.
                    message = await trio.to_thread.run_sync(_spec_by_file, request, directory, spec)
                sock = await self._send_spawn(message)
                with trio.move_on_after(SPAWN_TIMEOUT_S):
                    await self.receive_until(lambda: self._reply is not None or self._socket is not sock)
                answer = self._reply
                if answer is None:
                    if self._socket is sock:
                        await self._discard(sock, "did not answer a spawn")
                    raise OSError(f"the command host ended or did not answer within {SPAWN_TIMEOUT_S} s")
                reply: dict[str, Any] = answer
            finally:
                self._lock.release()
        if reply.get("op") == "failed":
            raise SpawnFailed(str(reply.get("stage")), int(reply.get("errno") or 0), str(reply.get("message")))
        process = self._processes.get(call_id)
        if reply.get("op") != "spawned" or reply.get("id") != call_id or process is None:
            await self._discard(sock, "answered out of turn")
            raise OSError("the command host answered out of turn")
        return process

    def _request(self, call_id: str, directory: Path, place: Sequence[Sequence[str]]) -> dict[str, Any]:
        request: dict[str, Any] = {"op": "spawn", "id": call_id, "dir": str(directory), "idle_shells": self.idle_shells}
        if place:
            request["place"] = [list(directories) for directories in place]
        return request

    async def _send_spawn(self, message: bytes) -> trio.socket.SocketType:
        """Send a spawn request; the socket it went to. A host found dead before the request
        reached it (it ended while idle: EPIPE, or its process already reaped) is replaced
        once: nothing of this spawn can have run. Any other refusal of the send fails the
        spawn alone, never the host and the commands it keeps."""
        for attempt in range(2):
            sock = await self._connect()
            raw = self._raw
            assert raw is not None  # set with the socket
            self._reply = None
            try:
                self._flush_unsent()
                try:
                    # Sent at once (the usual case: the host reads its requests as they come):
                    # trio's send yields after a send that went through, a pass of the event
                    # loop on every command's way. A full buffer waits as trio waits.
                    raw.send(message)
                except BlockingIOError:
                    await sock.send(message)
                return sock
            except (BrokenPipeError, ConnectionResetError, trio.ClosedResourceError):
                self._lost(sock)
                if attempt:
                    raise
            except OSError as exc:
                raise SpawnFailed("send", exc.errno or errno.EIO, str(exc)) from None
        raise AssertionError("unreachable")

    def stream_truncated(self, call_id: str, stream: str) -> None:
        """A stream of the command dropped bytes: should the host take it over, it keeps none
        after them (SpoolWriter.resume)."""
        if call_id not in self._processes or self._socket is None:
            return
        self._unsent.append(json.dumps({"op": "truncated", "id": call_id, "stream": stream}).encode())
        self._flush_unsent()

    def done(self, call_id: str) -> None:
        """The call completed: the host forgets the command (and records no exit for it).
        Queued: sent by `flush`, which the shell calls once the call's result is on its way
        (a send here wakes the host, which can take the daemon's core just before the
        commit and the send the agent waits for), or with the next spawn. Until the host
        hears it, a daemon that dies leaves an exit.json the next one never reads (the call
        is no longer pending)."""
        if self._processes.pop(call_id, None) is None or self._socket is None:
            return
        self._unsent.append(json.dumps({"op": "done", "id": call_id}).encode())

    def flush(self) -> None:
        """Send what `done` queued (what the socket has room for)."""
        self._flush_unsent()

    def _flush_unsent(self) -> None:
        raw = self._raw
        while self._unsent and raw is not None:
            try:
                raw.send(self._unsent[0])  # non-blocking (trio made it so)
            except BlockingIOError:
                return  # sent with the next spawn (a full 1 MiB buffer: the host is busy)
            except OSError:
                self._unsent.clear()  # the host is gone: nothing to forget
                return
            self._unsent.pop(0)

    # --- reading -------------------------------------------------------------------------

    async def receive_until(self, condition: Callable[[], bool]) -> None:
        """Read and dispatch the host's messages until `condition` holds (or the host ended:
        every waiter is then woken with what is known)."""
        while not condition():
            sock = self._socket
            if sock is None:
                return
            if self._reading:
                await self._dispatched.wait()
                continue
            raw = self._raw
            assert raw is not None  # set with the socket
            self._reading = True
            try:
                try:
                    data, ancillary = await _receive_message(raw)
                except (OSError, trio.ClosedResourceError):
                    data, ancillary = b"", []
                self._dispatch(sock, data, _received_fds(ancillary))
            finally:
                self._reading = False
                woken, self._dispatched = self._dispatched, trio.Event()
                woken.set()
            if not condition():
                # Someone else's message (another command's exit): the others it woke run
                # before this reader reads on.
                await trio.lowlevel.checkpoint()

    def _dispatch(self, sock: trio.socket.SocketType, data: bytes, fds: list[int]) -> None:
        if not data:
            self._lost(sock)
            return
        try:
            message = json.loads(data)
            op = message.get("op")
            call_id = str(message.get("id"))
        except (ValueError, AttributeError):
            op, call_id = None, ""
        if op == "exited":
            hosted = self._processes.get(call_id)
            if hosted is not None:
                hosted._set_status(int(message["status"]))
        elif op == "spawned" and len(fds) != _FDS_PER_SPAWN and self._reply is None:
            # The kernel dropped the descriptors (MSG_CTRUNC): this process is at its
            # descriptor limit. The command must not run untended: killed, forgotten, and the
            # spawn fails as a shortage (resource_exhausted frees the key).
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.killpg(int(message["pid"]), signal.SIGKILL)
            self._unsent.append(json.dumps({"op": "done", "id": call_id}).encode())
            self._reply = {"op": "failed", "id": call_id, "stage": "receive", "errno": errno.EMFILE, "message": ""}
            return
        elif op == "spawned" and self._reply is None:
            # Registered before anyone else reads: the `exited` that may follow must find it.
            self._processes[call_id] = HostedProcess(
                self,
                int(message["pid"]),
                int(message.get("start_ticks") or 0),
                trio.lowlevel.FdStream(fds[0]),
                trio.lowlevel.FdStream(fds[1]),
            )
            self._reply = message
            return
        elif op == "failed" and self._reply is None:
            self._reply = message
        for fd in fds:  # nobody takes them (a spawn given up on)
            os.close(fd)

    def _lost(self, sock: trio.socket.SocketType) -> None:
        """The host ended: its commands' exit statuses went with it."""
        if self._socket is not sock:
            return
        self._socket = None
        self._raw = None
        sock.close()
        self._unsent.clear()
        if self._processes:
            log.warning("shell.command_host_ended", commands=len(self._processes))
        for hosted in self._processes.values():
            hosted.exited.set()  # returncode None: wait() raises HostLost
        self._processes.clear()

    # --- the host process ----------------------------------------------------------------

    async def _connect(self) -> trio.socket.SocketType:
        if self._socket is not None:
            process = self._process
            if process is None or process.poll() is None:
                return self._socket
            self._lost(self._socket)  # it ended while nobody read its socket: a new one
        if self.closed:
            raise OSError("the command host is closed (the daemon is stopping)")
        await self._reap()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for end in (ours, theirs):
                for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    end.setsockopt(socket.SOL_SOCKET, option, MAX_MESSAGE_BYTES)
            self._process = await trio.lowlevel.open_process(
                [sys.executable, "-I", "-m", HOST_MODULE],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a stop's signals to the daemon's group miss it
                cwd="/",
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        sock = trio.socket.from_stdlib_socket(ours)
        self._socket = sock
        self._raw = ours  # the same socket, for the non-blocking sends of `done`
        return sock

    async def _reap(self) -> None:
        """Wait (briefly) for a previous host that ended or was discarded."""
        process = self._process
        if process is not None and process.returncode is None:
            with trio.move_on_after(HOST_EXIT_WAIT_S) as scope:
                scope.shield = True
                await process.wait()

    async def _discard(self, sock: trio.socket.SocketType, why: str) -> None:
        """Kill a host that failed; its commands are lost (HostLost), the next spawn starts a new one."""
        log.warning("shell.command_host_restarted", reason=why)
        process = self._process
        if process is not None and process.returncode is None:
            process.kill()
        self._lost(sock)
        await self._reap()

    async def aclose(self) -> None:
        """Close the socket: the host records what is still running (nothing, after a stop
        that ended every command) and exits; it is waited for briefly, not killed."""
        self.closed = True
        sock = self._socket
        if sock is not None:
            self._flush_unsent()
            self._lost(sock)
        await self._reap()


def _spec_by_file(request: dict[str, Any], directory: Path, spec: HolderSpec) -> bytes:
    """Write the spec beside the call's spool (created private, as the spool is) and return
    `request` naming it; the host reads and removes it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / HOST_SPEC_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(spec.to_json(), handle)
    return json.dumps({**request, "spec_file": HOST_SPEC_FILE}).encode()


async def _receive_message(raw: socket.socket) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    """The host's next message and its ancillary data: read at once when one is waiting,
    else once the socket is readable. trio's recvmsg yields after a read that succeeded as
    well, a pass of the event loop on each of a command's two answers (spawned, exited).
    Errors are the socket's (EBADF once it is closed); ClosedResourceError when it is closed
    while this waits (`fd_wait`, as for the control sockets)."""
    while True:
        try:
            data, ancillary, _flags, _addr = raw.recvmsg(MAX_MESSAGE_BYTES, _ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC)
            return data, ancillary
        except BlockingIOError:
            await fd_wait.wait_readable(raw)


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - (len(data) % received.itemsize)])
            fds.extend(received)
    return fds
