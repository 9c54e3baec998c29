"""The per-process holder: one small program per started process, so that nothing of the
process depends on the daemon being alive (docs/internals.md, "The holder").

    python -I -m sandbox_supervisor.daemon.runtime.holder <dir>

`<dir>` is the call's spool directory; it holds `spec.json` (written by the daemon). The holder
spawns the process, owns its pipes or its terminal, writes its output straight into the spool
(`stdout`, `stderr` and their `.state`, exactly the format of `spool.py`), enforces its
timeout, records its exit durably (`exit.json`) and serves `control.sock`, one client at a
time. It is started by `holder_launch.launch_holder`: detached (its own session, stdio on
/dev/null), so a `kill -9` of the daemon leaves the holder and its process running.

Stdlib only, and so is everything it imports (`spool`, `stdin_offsets`, `holder_protocol`,
`protocol/plain.py`): no pydantic, trio or structlog (a test asks a running holder for its
`sys.modules`). One thread, one `selectors` loop: the process's exit is a pidfd becoming
readable, output is pipe (or pty master) readability, stdin is writability, timers are the
select timeout.

Start: the launcher's child forks once more. The first process waits, on a pipe, until the
second (the holder) has written holder.json, then exits 0 (1 if there is no holder.json):
the launcher learns the outcome from an exit status rather than by polling, and the holder,
reparented away from the daemon, never becomes a zombie the daemon must reap.

Where this differs from (or adds to) the shared design of issue 10:
- spec.json may say `"stdin": "null"` (today's execute_shell_command: /dev/null as stdin);
  the default, `"pipe"`, is the design's.
- `output` events carry `kept` (bytes in the file) beside `total` (bytes written): they
  differ once the cap is hit. The `signal` reply says `delivered`; `close_stdin` answers `next`.
- A `modules` request (diagnostics: the modules loaded), so a test can check the import rule
  in a real holder.
- `exit_code` is null when a signal ended the process (`signal` names it), as in a tool result.
- With a uid and `groups: null`, the supplementary groups are emptied rather than kept: the
  holder's are root's.
- `close_stdin` on a terminal writes the EOF character (there is no descriptor to close).
- The timeout ends the process (and its group); once the process has exited, descendants
  holding the pipes are left to `terminate`, as today's lingering groups are.
- The holder is in a session of its own (it calls `setsid` in the forkserver's fork) or of
  its launcher's making (`start_new_session`): outside the daemon's session and group, with no
  controlling terminal (a pty's ends are opened `O_NOCTTY`).
- control.sock is unlinked as the holder exits (no socket + exit.json = ended).

Measured (`bench/run.py --only holder_launch`, 2 shared cores, Python 3.11): launch to
holder.json for `true` ≈ 41 ms median against ≈ 33 ms for a bare `python -I -c pass` in the
same run; to `hi` of `echo hi` in the spool ≈ 50 ms; a holder's VmRSS ≈ 10.7 MiB, 6.4 MiB of
it private (a bare interpreter: 4.7 MiB). docs/internals.md, "Measured", has the details.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import selectors
import signal
import socket
import struct
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

from sandbox_supervisor.daemon.runtime.holder_protocol import (
    BAD_SPEC,
    CONTROL_SOCKET,
    EXIT_FILE,
    HOLDER_FILE,
    HOLDER_ERROR,
    HOLDER_FAILED,
    LINE_TOO_LONG,
    NOT_A_TERMINAL,
    NOT_RUNNING,
    SPAWN_FAILED,
    SPEC_FILE,
    STDIN_CLOSED,
    STDIN_GAP,
    ExitRecord,
    HolderInfo,
    HolderSpec,
    LineSplitter,
    LineTooLong,
    Request,
    RequestError,
    SpecError,
    event_ended,
    event_exited,
    event_output,
    parse_request,
    parse_spec,
    reply_error,
    reply_ok,
    reply_stdin,
    write_json_atomic,
)
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter
from sandbox_supervisor.daemon.runtime.stdin_offsets import StdinClosed, StdinGap, StdinOffsets
from sandbox_supervisor.protocol.plain import Stream

__all__ = ["main", "run_holder"]

# Bytes read from a pipe or the terminal per read, and the size asked for the output pipes
# (F_SETPIPE_SZ; Linux's default is 64 KiB). Larger pipes let a fast writer run ahead while
# the holder writes to the spool, and make each loop turn carry more: a 200 MB output goes
# through at about twice the rate it has with 64 KiB. Kernel memory, only while full.
READ_CHUNK_BYTES = 256 * 1024
OUTPUT_PIPE_BYTES = 256 * 1024
# Replies and events queued for a client that does not read: above this, the holder stops
# reading its requests (so a client that only writes cannot grow the queue) and stops adding
# output events (they are coalesced: the latest total is sent once the queue drains).
CLIENT_QUEUE_HIGH_BYTES = 64 * 1024
# How long the holder, ending, keeps trying to deliver its last events to a slow client.
FINAL_FLUSH_TIMEOUT_S = 1.0
# Without a pidfd (kernels before 5.3) the exit is noticed by polling waitpid this often.
REAP_POLL_S = 0.05
# Exit status of a child that could not exec (as a shell reports "command not found").
EXEC_FAILED_STATUS = 127
OOM_SCORE_ADJ_FILE = "/proc/self/oom_score_adj"


def _now_iso() -> str:
    """UTC, ISO 8601 to the millisecond (time, not datetime: 0.3 MiB less per holder)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"


def _start_ticks(pid: int | str) -> int:
    """Field 22 of /proc/PID/stat: with the pid, the process's identity across pid reuse."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
        text = handle.read()
    return int(text.rpartition(")")[2].split()[19])


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


# --- spawning --------------------------------------------------------------------------------

# Signals a parent may leave ignored or blocked: a shell starts a background job (`&`) with
# SIGINT and SIGQUIT ignored, `nohup` with SIGHUP, and some process managers block signals.
# Both survive fork and exec (only caught signals are reset), so every command would inherit
# them, and bash may not undo an ignored one (POSIX: a signal ignored on entry to a
# non-interactive shell cannot be trapped or reset): `exec.signal` SIGINT and a Ctrl-C on a
# terminal would reach a command that ignores them. An ignored SIGCHLD would have the kernel
# reap the host's and the holders' children before they can read an exit status. Kept as
# they are: SIGPIPE and SIGXFSZ, which Python ignores on purpose (and puts back in each
# child), and SIGKILL and SIGSTOP, which cannot be changed.
_KEPT_SIGNALS = frozenset({signal.SIGPIPE, signal.SIGXFSZ, signal.SIGKILL, signal.SIGSTOP})


def restore_inherited_signals() -> None:
    """Unblock every signal, and give every one this process started with ignored (but
    _KEPT_SIGNALS) its default disposition back, before it spawns any command: what a
    command starts with does not depend on how the daemon was started."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for signum in signal.valid_signals():
        if signum in _KEPT_SIGNALS:
            continue
        try:
            if signal.getsignal(signum) is signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # refused by this platform: left as it is


class SpawnError(Exception):
    def __init__(self, stage: str, code: int) -> None:
        super().__init__(f"{stage}: {os.strerror(code)}")
        self.stage = stage
        self.errno = code


class Stdio(NamedTuple):
    """The child's ends (closed in the holder after the fork) and the holder's ends."""

    child_stdin: int | None  # None: /dev/null
    child_stdout: int
    child_stderr: int
    pty_slave: int | None
    stdin: int | None  # the holder's write end (a pty: a duplicate of the master)
    outputs: dict[Stream, int]  # the holder's read ends (a pty: the master, as stdout)
    pty_master: int | None


def open_stdio(spec: HolderSpec) -> Stdio:
    if spec.pty is not None:
        master, slave = os.openpty()
        _set_window(master, spec.pty.rows, spec.pty.cols)
        return Stdio(slave, slave, slave, slave, os.dup(master), {"stdout": master}, master)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for fd in (out_r, err_r):
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, OUTPUT_PIPE_BYTES)
        except OSError:
            pass  # over /proc/sys/fs/pipe-max-size or the user's pipe budget: the default
    child_stdin = holder_stdin = None
    if spec.stdin == "pipe":
        child_stdin, holder_stdin = os.pipe()
    return Stdio(child_stdin, out_w, err_w, None, holder_stdin, {"stdout": out_r, "stderr": err_r}, None)


def _set_window(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _child(spec: HolderSpec, stdio: Stdio, report: int) -> NoReturn:
    """In the forked child: never returns. Each step as root, then the ids, then exec; a
    failure is written to `report` as "stage:errno" (exec closes it on success)."""
    stage = "setsid"
    try:
        os.setsid()  # its own session and process group: signals reach every descendant
        stage = "stdio"
        if stdio.pty_slave is not None:
            fcntl.ioctl(stdio.pty_slave, termios.TIOCSCTTY, 0)  # the terminal is its ctty
        stdin = stdio.child_stdin
        if stdin is None:
            stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(stdio.child_stdout, 1)
        os.dup2(stdio.child_stderr, 2)
        if spec.oom_score_adj is not None:
            # Before exec, in the process itself: nothing it forks keeps the daemon's
            # protection (oom.py). Best effort, like the wrapper it replaces.
            try:
                with open(OOM_SCORE_ADJ_FILE, "w") as handle:
                    handle.write(str(spec.oom_score_adj))
            except OSError:
                pass
        if spec.cgroup is not None:
            stage = "cgroup"  # as root, before the switch; a failure stops the spawn
            for directory in spec.cgroup_directories:
                with open(os.path.join(directory, "cgroup.procs"), "w") as handle:
                    handle.write(str(os.getpid()))
        stage = "cwd"  # as root, as CPython's subprocess does it: cwd first, then the ids
        os.chdir(spec.cwd)
        stage = "identity"
        if spec.uid is not None:
            os.setgroups(list(spec.groups or ()))
        elif spec.groups is not None:
            os.setgroups(list(spec.groups))
        if spec.gid is not None:
            os.setgid(spec.gid)
        if spec.uid is not None:
            os.setuid(spec.uid)
        # Python ignores SIGPIPE and SIGXFSZ; an ignored signal stays ignored across exec.
        for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        stage = "exec"
        os.execvpe(spec.argv[0], list(spec.argv), spec.env)
    except OSError as exc:
        code = exc.errno or errno.EIO
    except BaseException:
        code = errno.EINVAL
    try:
        os.write(report, f"{stage}:{code}".encode())
    finally:
        os._exit(EXEC_FAILED_STATUS)


def spawn(spec: HolderSpec, stdio: Stdio) -> int:
    """Fork and exec the process; its pid once exec succeeded, else SpawnError (reaped)."""
    report_r, report_w = os.pipe()  # close-on-exec: EOF means exec succeeded
    try:
        pid = os.fork()
    except OSError:
        # No fork (EAGAIN at the process limit, ENOMEM): nothing started; the child's ends
        # are the caller's to close with its own.
        os.close(report_r)
        os.close(report_w)
        raise
    if pid == 0:
        _child(spec, stdio, report_w)
    os.close(report_w)
    try:
        chunks = []
        while chunk := os.read(report_r, 256):
            chunks.append(chunk)
    finally:
        os.close(report_r)
    for fd in {stdio.child_stdin, stdio.child_stdout, stdio.child_stderr, stdio.pty_slave}:
        if fd is not None:
            os.close(fd)
    if chunks:
        os.waitpid(pid, 0)
        stage, _, code = b"".join(chunks).decode().partition(":")
        raise SpawnError(stage, int(code))
    return pid


# How a holder starts its process: the pid once it exec'd; else SpawnError (the child's ends
# of `stdio` closed), or OSError when no fork could be made (they may still be open: a holder
# that fails so exits, which closes them).
SpawnFunction = Callable[[HolderSpec, Stdio], int]


# --- the holder ------------------------------------------------------------------------------


class Client:
    """The one control connection: its requests in, its replies and events out."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.lines = LineSplitter()
        self.queue = bytearray()
        self.watching = False
        self.sent_totals: dict[Stream, int] = {}
        self.exited_sent = False
        self.reading = True


class Holder:
    def __init__(self, directory: Path, spec: HolderSpec, spawn_process: SpawnFunction | None = None) -> None:
        self.directory = directory
        self.spec = spec
        self.spawn_process: SpawnFunction = spawn if spawn_process is None else spawn_process
        self.selector = selectors.DefaultSelector()
        self.writers: dict[Stream, SpoolWriter] = {
            name: SpoolWriter(directory / name, spec.spool_max_bytes) for name in spec.streams
        }
        self.outputs: dict[Stream, int] = {}
        self.stdin_fd: int | None = None
        self.pty_master: int | None = None
        self.stdin = StdinOffsets()
        self.stdin_last_byte = b"\n"
        self.pid = 0
        self.pidfd: int | None = None
        self.started = 0.0
        self.timeout_at: float | None = None
        self.kill_at: float | None = None
        self.timed_out = False
        self.exit: ExitRecord | None = None
        self.exit_recorded = False
        self.client: Client | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Every read (the control socket's, the outputs') lands here and is used before the
        # next one: a fresh READ_CHUNK_BYTES object per read would be allocated, mapped,
        # shrunk and unmapped on each keystroke (three system calls beside the read). An
        # anonymous mapping, not a bytearray: its pages become memory only as reads reach
        # them (a keystroke's echo touches one), where a bytearray is zeroed whole at once.
        self._buffer = mmap.mmap(-1, READ_CHUNK_BYTES)
        self._view = memoryview(self._buffer)

    # -- start --

    def start(self) -> HolderInfo:
        # Relative name: the holder's cwd is its directory, and sun_path is only 108 bytes.
        self.listener.bind(CONTROL_SOCKET)
        os.chmod(CONTROL_SOCKET, 0o600)
        self.listener.listen(4)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, self._on_accept)
        stdio = open_stdio(self.spec)
        self.started = time.monotonic()
        try:
            self.pid = self.spawn_process(self.spec, stdio)
        except BaseException:
            for fd in [*stdio.outputs.values(), stdio.stdin]:
                if fd is not None:
                    os.close(fd)
            self.listener.close()
            os.unlink(CONTROL_SOCKET)  # nothing runs: no socket to suggest otherwise
            raise
        if self.spec.timeout_s is not None:
            self.timeout_at = self.started + self.spec.timeout_s
        for name, fd in stdio.outputs.items():
            os.set_blocking(fd, False)
            self.outputs[name] = fd
            self.selector.register(fd, selectors.EVENT_READ, lambda _mask, name=name: self._on_output(name))
        self.pty_master = stdio.pty_master
        self.stdin_fd = stdio.stdin
        if self.stdin_fd is not None:
            os.set_blocking(self.stdin_fd, False)
        try:
            self.pidfd = os.pidfd_open(self.pid)
            self.selector.register(self.pidfd, selectors.EVENT_READ, lambda _mask: self._reap())
        except (OSError, AttributeError):
            self.pidfd = None  # polled instead (REAP_POLL_S)
        return HolderInfo(
            holder_pid=os.getpid(),
            holder_start_ticks=_start_ticks("self"),
            pid=self.pid,
            pgid=self.pid,  # setsid: it leads its own group
            start_ticks=_start_ticks(self.pid),
            started_at=_now_iso(),
        )

    # -- the loop --

    def finished(self) -> bool:
        return self.exit is not None and not self.outputs

    def run(self) -> None:
        while not self.finished():
            for key, mask in self.selector.select(self._select_timeout()):
                key.data(mask)
            self._timers()
            if self.pidfd is None and self.exit is None:
                self._reap()
            self._queue_events()
        self._end()

    def _select_timeout(self) -> float | None:
        deadlines = [t for t in (self.timeout_at, self.kill_at) if t is not None]
        timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        if self.pidfd is None and self.exit is None:
            timeout = REAP_POLL_S if timeout is None else min(timeout, REAP_POLL_S)
        return timeout

    def _timers(self) -> None:
        now = time.monotonic()
        if self.timeout_at is not None and now >= self.timeout_at:
            self.timeout_at = None
            if self.exit is None:
                self.timed_out = True
                self.terminate()
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            self._kill_everything()

    # -- the process --

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if self.pidfd is not None:
            self.selector.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        self.timeout_at = None
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        signame = _signal_name(os.WTERMSIG(status)) if os.WIFSIGNALED(status) else None
        self.exit = ExitRecord(
            exit_code=exit_code,
            signal=signame,
            timed_out=self.timed_out,
            oom_killed=self._oom_killed(),
            duration_ms=round((time.monotonic() - self.started) * 1000),
            ended_at=_now_iso(),
        )
        self._record_exit()
        # Its stdin ends with it (a background descendant reading it gets end-of-file).
        self.stdin.reader_gone()
        self._close_stdin_fd()
        if self.pty_master is not None and "stdout" not in self.outputs:
            self._close_terminal()  # its end was read while the process was exiting

    def _record_exit(self) -> None:
        """exit.json; a disk that refuses it (ENOSPC …) does not stop the holder: the client
        still gets `exited`, and the write is tried again as the holder ends."""
        assert self.exit is not None
        try:
            write_json_atomic(self.directory / EXIT_FILE, self.exit.to_json(), durable=True)
            self.exit_recorded = True
        except OSError:
            self.exit_recorded = False

    def _oom_killed(self) -> bool | None:
        if self.spec.cgroup is None:
            return None
        try:
            with open(os.path.join(self.spec.cgroup, "memory.events"), encoding="ascii") as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value) > 0
        except (OSError, ValueError):
            pass
        return None

    def _cgroup_pids(self) -> list[int]:
        if self.spec.cgroup is None:
            return []
        try:
            with open(os.path.join(self.spec.cgroup, "cgroup.procs"), encoding="ascii") as handle:
                return [int(line) for line in handle if line.strip()]
        except (OSError, ValueError):
            return []

    def send_signal(self, signum: int) -> bool:
        """To the process group, and to every process of the cgroup (descendants that left
        the group with setsid stay in the cgroup). False when none was reached."""
        delivered = False
        try:
            os.killpg(self.pid, signum)
            delivered = True
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self._cgroup_pids():
            try:
                os.kill(pid, signum)
                delivered = True
            except (ProcessLookupError, PermissionError):
                pass
        return delivered

    def terminate(self) -> None:
        """SIGTERM now, SIGKILL to whatever is left after the grace."""
        self.send_signal(signal.SIGTERM)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.spec.kill_grace_s

    def _kill_everything(self) -> None:
        if self.spec.cgroup is not None:
            try:
                with open(os.path.join(self.spec.cgroup, "cgroup.kill"), "w") as handle:
                    handle.write("1")
            except OSError:
                pass  # no cgroup.kill (kernel < 5.14, or v1): the signals below
        self.send_signal(signal.SIGKILL)

    # -- output --

    def _on_output(self, name: Stream) -> None:
        fd = self.outputs[name]
        try:
            count = os.readv(fd, [self._buffer])
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EIO:  # EIO: a pty's master once no slave is open: its end
                raise
            count = 0
        if count:
            self.writers[name].write(self._view[:count])
            return
        self.selector.unregister(fd)
        del self.outputs[name]
        self.writers[name].close()
        if fd != self.pty_master:
            os.close(fd)
        elif self.exit is not None:
            self._close_terminal()
        # else: the terminal is closed once the process is reaped. Closing a pty's master
        # hangs the terminal up, which sends SIGHUP to its session leader; a process that
        # is exiting (its descriptors are closed, hence this EIO) but not yet reaped would
        # then be reported as killed by SIGHUP instead of its real exit status.

    def _close_terminal(self) -> None:
        if self.pty_master is not None:
            os.close(self.pty_master)
            self.pty_master = None

    # -- stdin --

    def _pump_stdin(self) -> None:
        fd = self.stdin_fd
        if fd is None:
            return
        pending = self.stdin.pending()
        if pending:
            try:
                count = os.write(fd, pending)
            except BlockingIOError:
                count = 0
            except OSError:  # EPIPE: the process closed its stdin; EIO: the terminal is gone
                self.stdin.reader_gone()
                self._close_stdin_fd()
                return
            self.stdin.written_out(count)
            if count:
                self.stdin_last_byte = pending[count - 1 : count]
        if self.stdin.eof_due:
            if self.spec.pty is not None:
                self._send_terminal_eof(fd)
            self._close_stdin_fd()
            return
        self._set_stdin_interest(bool(self.stdin.buffered))

    def _send_terminal_eof(self, fd: int) -> None:
        """A terminal has no end-of-file to close: the line discipline's EOF character ends a
        read at the start of a line, so a pending partial line is flushed with one first."""
        try:
            eof = termios.tcgetattr(fd)[6][termios.VEOF]
            character = eof if isinstance(eof, bytes) else bytes([eof])
            os.write(fd, character if self.stdin_last_byte == b"\n" else character * 2)
        except OSError:
            pass

    def _set_stdin_interest(self, wanted: bool) -> None:
        fd = self.stdin_fd
        if fd is None:
            return
        registered = fd in self.selector.get_map()
        if wanted and not registered:
            self.selector.register(fd, selectors.EVENT_WRITE, lambda _mask: self._pump_stdin())
        elif not wanted and registered:
            self.selector.unregister(fd)

    def _close_stdin_fd(self) -> None:
        if self.stdin_fd is None:
            return
        self._set_stdin_interest(False)
        os.close(self.stdin_fd)
        self.stdin_fd = None

    # -- the control socket --

    def _on_accept(self, _mask: int) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        # One client at a time: the newest wins (a restarted daemon takes over this way).
        self._drop_client()
        self.client = Client(sock)
        self._client_interest()

    def _drop_client(self) -> None:
        if self.client is None:
            return
        self.selector.unregister(self.client.sock)
        self.client.sock.close()
        self.client = None

    def _client_interest(self) -> None:
        client = self.client
        if client is None:
            return
        client.reading = len(client.queue) < CLIENT_QUEUE_HIGH_BYTES
        events = (selectors.EVENT_READ if client.reading else 0) | (
            selectors.EVENT_WRITE if client.queue else 0
        )
        if client.sock in self.selector.get_map():
            self.selector.modify(client.sock, events, self._on_client)
        else:
            self.selector.register(client.sock, events, self._on_client)

    def _send_queued(self) -> bool:
        """Write what is queued for the client now, as far as its socket takes it (False:
        the client is gone). A reply or an event leaves in the turn that made it: waiting for
        the selector to report the socket writable would cost, for each, an interest change,
        another select and a change back (a keystroke makes a reply and an output event).
        Only what the socket does not take waits for EVENT_WRITE."""
        client = self.client
        if client is None:
            return False
        if client.queue:
            try:
                sent = client.sock.send(client.queue)
                del client.queue[:sent]
            except BlockingIOError:
                pass
            except OSError:
                self._drop_client()
                return False
        return True

    def _on_client(self, mask: int) -> None:
        client = self.client
        if client is None:
            return
        if mask & selectors.EVENT_WRITE and not self._send_queued():
            return
        if mask & selectors.EVENT_READ and client.reading:
            try:
                count: int | None = client.sock.recv_into(self._buffer)
            except BlockingIOError:
                count = None
            except OSError:
                count = 0
            if count == 0:
                self._drop_client()
                return
            if count:
                try:
                    lines = client.lines.feed(self._view[:count])
                except LineTooLong as exc:
                    client.queue += reply_error(LINE_TOO_LONG, str(exc))
                    self._flush_and_drop()
                    return
                for line in lines:
                    client.queue += self._answer(line)
                if not self._send_queued():
                    return
        self._client_interest()

    def _flush_and_drop(self) -> None:
        client = self.client
        if client is not None:
            try:
                client.sock.setblocking(True)
                client.sock.settimeout(FINAL_FLUSH_TIMEOUT_S)
                client.sock.sendall(client.queue)
            except OSError:
                pass
        self._drop_client()

    def _answer(self, line: bytes) -> bytes:
        try:
            request = parse_request(line)
            return self._handle(request)
        except RequestError as exc:
            return reply_error(exc.code, exc.message)
        except Exception as exc:
            # A failure on one request must not end the holder: the process would lose the
            # reader of its output and the record of its exit.
            return reply_error(HOLDER_ERROR, f"{type(exc).__name__}: {exc}")

    def _handle(self, request: Request) -> bytes:
        if request.op == "watch":
            if self.client is not None:
                self.client.watching = True
                self.client.sent_totals = {}  # every stream's total is sent, 0 included
            return reply_ok()
        if request.op == "stdin":
            if self.exit is not None:
                return reply_error(NOT_RUNNING, "the process has exited")
            # Every answer says where stdin stands (`next`) and whether it is closed, so a
            # client retrying after a lost answer learns both, whatever it sent.
            if self.stdin_fd is None and not self.stdin.closed:
                return reply_error(STDIN_CLOSED, "the process has no stdin to write to", next=self.stdin.next)
            try:
                accepted = self.stdin.offer(request.offset, request.data)
            except StdinGap as gap:
                return reply_error(STDIN_GAP, str(gap), expected=gap.expected, next=gap.expected)
            except StdinClosed:
                return reply_error(STDIN_CLOSED, "stdin is closed", next=self.stdin.next)
            self._pump_stdin()
            return reply_stdin(accepted, self.stdin.closed)
        if request.op == "close_stdin":
            if self.exit is not None:
                return reply_error(NOT_RUNNING, "the process has exited")
            try:
                self.stdin.close(request.offset)
            except StdinGap as gap:
                return reply_error(STDIN_GAP, str(gap), expected=gap.expected, next=gap.expected, closed=self.stdin.closed)
            self._pump_stdin()
            return reply_stdin(self.stdin.next, True)
        if request.op == "resize":
            if self.spec.pty is None:
                return reply_error(NOT_A_TERMINAL, "the process has no terminal")
            if self.pty_master is None:
                return reply_error(NOT_RUNNING, "the terminal is closed")
            _set_window(self.pty_master, request.rows, request.cols)
            return reply_ok()
        if request.op == "signal":
            return reply_ok(delivered=self.send_signal(request.signum))
        if request.op == "terminate":
            self.terminate()
            return reply_ok()
        return reply_ok(modules=sorted(sys.modules))

    def _queue_events(self) -> None:
        """Coalesced: each stream's latest total, once the client has read what was queued."""
        client = self.client
        if client is None or not client.watching:
            return
        if len(client.queue) >= CLIENT_QUEUE_HIGH_BYTES:
            return
        before = len(client.queue)
        for name, writer in self.writers.items():
            if client.sent_totals.get(name) != writer.total:
                client.sent_totals[name] = writer.total
                client.queue += event_output(name, writer.total, writer.size)
        if self.exit is not None and not client.exited_sent:
            client.exited_sent = True
            client.queue += event_exited(self.exit)
        if len(client.queue) != before and self._send_queued():
            self._client_interest()

    # -- the end --

    def _end(self) -> None:
        """Every stream ended and exit.json is written: tell the client, then go."""
        for writer in self.writers.values():
            writer.close()
        if not self.exit_recorded:
            self._record_exit()
        self._queue_events()
        if self.client is not None and self.client.watching:
            self.client.queue += event_ended()
        self._flush_and_drop()
        try:
            os.unlink(CONTROL_SOCKET)
        except OSError:
            pass
        self.listener.close()


# --- entry points ------------------------------------------------------------------------------


def _write_error(directory: Path, code: str, message: str) -> None:
    write_json_atomic(directory / HOLDER_FILE, {"error": {"code": code, "message": message}})


def prepare_process() -> None:
    """What a holder sets on itself before anything else, whatever its spec: its umask and
    its signals (restore_inherited_signals). A spare holder does it while it waits."""
    os.umask(0o077)
    restore_inherited_signals()


# What a spare's warm_up hands Holder and parse_spec: nothing of it is created or run.
_WARM_UP_SPEC = HolderSpec(
    argv=("/bin/sh", "-c", ":"), cwd="/", env={"PATH": "/usr/bin:/bin"}, cgroup="/", cgroup_also=("/",), stdin="pipe"
)


def warm_up() -> None:
    """Run, on nothing, the code a holder's start runs, so that the pages it writes (reference
    counts, caches, the allocator's) are this process's own before a start waits for them.

    Why: a spare is a fork of the server, and every page of the server's that the start
    writes is copied first, a page fault each (3–7 µs in this VM). A start made about 460 of
    them, 1.5–2 ms of the holder's 5–6 ms; after this, about 75. Best effort: nothing here
    is needed, so a failure leaves the spare as it was."""
    try:
        _warm_up_steps()
    except Exception:  # noqa: BLE001 - a warm-up that fails costs only the faults it saved
        pass


def _warm_up_steps() -> None:
    spec = parse_spec(json.loads(json.dumps(_WARM_UP_SPEC.to_json(), sort_keys=True)))
    # A directory that exists and never has a `stdout` or `stderr` entry (its names are
    # descriptor numbers): the stream files are looked for, not made, the socket is never
    # bound, and nothing is written.
    holder = Holder(Path("/proc/self/fdinfo"), spec)
    holder.selector.close()
    holder.listener.close()
    holder._view.release()
    holder._buffer.close()
    stdio = open_stdio(spec)
    for fd in {stdio.child_stdin, stdio.child_stdout, stdio.child_stderr, stdio.stdin, *stdio.outputs.values()}:
        if fd is not None:
            os.close(fd)
    info = HolderInfo(os.getpid(), _start_ticks("self"), 0, 0, 0, _now_iso())
    json.dumps(info.to_json(), sort_keys=True)


def run_holder(
    directory: Path, ready_fd: int | None = None, spawn_process: SpawnFunction | None = None, *, prepared: bool = False
) -> int:
    """Be the holder of the spec in `directory`; `ready_fd` is closed once holder.json exists.
    `spawn_process` starts the process (default `spawn`; the fork server passes its
    `spawner.Spawner`'s, which this module cannot import: that module imports this one).
    `prepared`: prepare_process has run already."""
    if not prepared:
        prepare_process()
    os.chdir(directory)  # the control socket is bound by a short relative name
    try:
        try:
            spec = parse_spec(json.loads((directory / SPEC_FILE).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            _write_error(directory, BAD_SPEC, str(exc) if isinstance(exc, SpecError) else f"cannot read the spec: {exc}")
            return 1
        try:
            holder = Holder(directory, spec, spawn_process)
            info = holder.start()
        except SpawnError as exc:
            _write_error(directory, SPAWN_FAILED, str(exc))
            return 1
        except Exception as exc:  # the holder itself could not start (spool exists, socket …)
            _write_error(directory, HOLDER_FAILED, f"{type(exc).__name__}: {exc}")
            return 1
        write_json_atomic(directory / HOLDER_FILE, info.to_json())
    finally:
        if ready_fd is not None:
            os.close(ready_fd)
    holder.run()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -I -m sandbox_supervisor.daemon.runtime.holder <dir>", file=sys.stderr)
        return 2
    directory = Path(argv[0]).resolve()
    ready_r, ready_w = os.pipe()
    if os.fork():
        # The launcher's child: wait until the holder has written holder.json (or died),
        # then tell the launcher by the exit status. The holder lives on, reparented.
        os.close(ready_w)
        while os.read(ready_r, 1):
            pass
        # _exit: the interpreter's own shutdown would only delay the launcher.
        os._exit(0 if (directory / HOLDER_FILE).exists() else 1)
    os.close(ready_r)
    return run_holder(directory, ready_w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
