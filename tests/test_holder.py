"""The per-process holder, for real: real holder processes started by `launch_holder`, real
commands, pipes, terminals, unix sockets, uid switches and (as root) a private cgroup2 mount.

Each test talks to the holder as the daemon will: through `control.sock` with the codec of
`holder_protocol`, and by reading the files of its directory.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.runtime.holder_launch import HolderLaunchError, launch_holder
from sandbox_supervisor.daemon.runtime.holder_protocol import (
    CONTROL_SOCKET,
    EXIT_FILE,
    MAX_LINE_BYTES,
    EndedEvent,
    ExitedEvent,
    ExitRecord,
    HolderInfo,
    HolderSpec,
    LineSplitter,
    Message,
    OutputEvent,
    Reply,
    TerminalSize,
    control_socket_path,
    decode_message,
    encode_close_stdin,
    encode_modules,
    encode_resize,
    encode_signal,
    encode_stdin,
    encode_terminate,
    encode_watch,
    read_exit,
)
from sandbox_supervisor.daemon.runtime.spool import read_state
from sandbox_supervisor.daemon.runtime.stdin_offsets import DEFAULT_STDIN_BUFFER_BYTES

WAIT_S = 10.0  # deadline for anything a test waits for (generous: 2 shared cores)
POLL_S = 0.01
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PIPE_CAPACITY = 64 * 1024  # Linux's default pipe buffer
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root (CI runs as root)")


def spec(argv: list[str], **overrides: object) -> HolderSpec:
    fields: dict[str, object] = {"argv": tuple(argv), "cwd": "/", "env": {"PATH": PATH}, "kill_grace_s": 1.0}
    fields.update(overrides)
    return HolderSpec(**fields)  # type: ignore[arg-type]


def sh(script: str, **overrides: object) -> HolderSpec:
    return spec(["/bin/sh", "-c", script], **overrides)


@pytest.fixture
def holder_dir(tmp_path) -> Iterator[Callable[[], Path]]:
    """Fresh call directories; every holder still alive at the end is killed with its group."""
    made: list[Path] = []

    def make() -> Path:
        path = tmp_path / "spool" / str(uuid.uuid4())
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            info = json.loads((path / "holder.json").read_text())
            os.killpg(info["pgid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
        try:
            os.kill(info["holder_pid"], signal.SIGKILL)
        except (OSError, UnboundLocalError, KeyError, TypeError):
            pass


def wait_until(predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def wait_for_exit(directory: Path) -> ExitRecord:
    wait_until(lambda: (directory / EXIT_FILE).exists(), "exit.json")
    record = read_exit(directory)
    assert record is not None
    return record


def wait_for_end(directory: Path) -> None:
    """The holder is done: its socket is gone (it unlinks it last)."""
    wait_until(lambda: (directory / EXIT_FILE).exists() and not (directory / CONTROL_SOCKET).exists(), "the holder's end")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def processes_naming(directory: Path) -> list[int]:
    """Live (non-zombie) processes with `directory` in their command line: a holder's."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(directory).encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


class Control:
    """A blocking control connection, the way a test (not the daemon) talks to a holder."""

    def __init__(self, directory: Path) -> None:
        self.dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(control_socket_path(self.dir_fd))
        self.lines = LineSplitter()
        self.pending: collections.deque[Message] = collections.deque()
        self.events: list[Message] = []

    def close(self) -> None:
        self.sock.close()
        os.close(self.dir_fd)

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _next(self) -> Message:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the holder closed the connection")
            self.pending.extend(decode_message(line) for line in self.lines.feed(data))
        return self.pending.popleft()

    def request(self, line: bytes) -> Reply:
        self.sock.sendall(line)
        while True:
            message = self._next()
            if isinstance(message, Reply):
                return message
            self.events.append(message)

    def until(self, predicate: Callable[[Message], bool]) -> Message:
        for event in self.events:
            if predicate(event):
                return event
        while True:
            message = self._next()
            self.events.append(message)
            if predicate(message):
                return message

    def output_total(self, stream: str, total: int) -> OutputEvent:
        event = self.until(lambda m: isinstance(m, OutputEvent) and m.stream == stream and m.total >= total)
        assert isinstance(event, OutputEvent)
        return event


def spool_text(directory: Path, stream: str = "stdout") -> str:
    try:
        return (directory / stream).read_bytes().decode()  # bytes: a terminal's \r\n kept
    except FileNotFoundError:
        return ""


# --- stdlib only -------------------------------------------------------------------------


def test_a_running_holder_has_imported_only_the_standard_library(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"], stdin="null"))
    with Control(directory) as control:
        reply = control.request(encode_modules())
        assert control.request(encode_terminate()).ok
    assert reply.ok
    modules = set(reply.fields["modules"])
    ours = {name for name in modules if name.startswith("sandbox_supervisor")}
    foreign = {
        name for name in modules - ours if name.partition(".")[0] not in sys.stdlib_module_names
    }
    # What `site` loads from .pth files before any of our code runs (the editable install's
    # import hook, setuptools' distutils shim) is the environment's, not the holder's.
    # The holder itself runs as __main__.
    foreign = {name for name in foreign if name != "__main__" and not name.startswith(("__editable__", "_distutils_hack"))}
    assert foreign == set()
    assert not {"pydantic", "trio", "structlog"} & {name.partition(".")[0] for name in modules}
    assert "sandbox_supervisor.daemon.runtime.spool" in ours
    assert "sandbox_supervisor.protocol.fields" not in ours  # the pydantic half of the fields


# --- output --------------------------------------------------------------------------------


def test_output_lands_in_the_spool_and_watch_reports_it_then_exited_then_ended(holder_dir):
    directory = holder_dir()
    # Waits for one line of stdin, so the test is watching before any output is written.
    launch_holder(directory, sh("read -r go; seq 1 20000; seq 1 3000 >&2; printf tail"))
    expected_out = "".join(f"{i}\n" for i in range(1, 20001)) + "tail"
    expected_err = "".join(f"{i}\n" for i in range(1, 3001))
    with Control(directory) as control:
        assert control.request(encode_watch()).ok
        assert control.request(encode_stdin(0, b"go\n")).fields["next"] == 3
        control.until(lambda m: isinstance(m, EndedEvent))
        events = control.events
    assert spool_text(directory) == expected_out
    assert spool_text(directory, "stderr") == expected_err
    outputs = [e for e in events if isinstance(e, OutputEvent)]
    last = {e.stream: e for e in outputs}
    assert (last["stdout"].total, last["stdout"].kept) == (len(expected_out), len(expected_out))
    assert last["stderr"].total == len(expected_err)
    for stream in ("stdout", "stderr"):
        totals = [e.total for e in outputs if e.stream == stream]
        assert totals == sorted(totals) and totals[0] == 0  # watch starts from where the spool is
    kinds = [type(e) for e in events]
    assert kinds[-1] is EndedEvent and kinds.count(ExitedEvent) == 1
    exited = next(e for e in events if isinstance(e, ExitedEvent))
    assert (exited.record.exit_code, exited.record.signal, exited.record.timed_out) == (0, None, False)
    assert exited.record == read_exit(directory)
    for stream, text in (("stdout", expected_out), ("stderr", expected_err)):
        state = read_state(directory / stream)
        assert state is not None and state.ended and state.total == len(text) and not state.truncated
    wait_for_end(directory)


def test_the_spool_cap_is_honoured_per_stream(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("seq 1 10000; seq 1 10 >&2", stdin="null", spool_max_bytes=1000))
    record = wait_for_exit(directory)
    wait_for_end(directory)
    assert record.exit_code == 0
    full = "".join(f"{i}\n" for i in range(1, 10001))
    assert spool_text(directory) == full[:1000]
    state = read_state(directory / "stdout")
    assert state is not None and (state.ended, state.total, state.kept, state.truncated) == (True, len(full), 1000, True)
    err = read_state(directory / "stderr")
    assert err is not None and not err.truncated and spool_text(directory, "stderr") == "".join(f"{i}\n" for i in range(1, 11))


def test_an_exit_while_nobody_is_connected_leaves_a_correct_exit_json(holder_dir):
    directory = holder_dir()
    info = launch_holder(directory, sh("echo out; exit 3", stdin="null"))
    record = wait_for_exit(directory)
    wait_for_end(directory)
    assert (record.exit_code, record.signal, record.timed_out, record.oom_killed) == (3, None, False, None)
    assert record.duration_ms >= 0 and record.ended_at.endswith("Z")
    assert spool_text(directory) == "out\n"
    wait_until(lambda: not alive(info.holder_pid), "the holder to exit")


def test_background_output_after_the_exit_is_spooled_and_ended_waits_for_it(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("(sleep 0.5; echo late) & echo early"))
    with Control(directory) as control:
        assert control.request(encode_watch()).ok
        exited = control.until(lambda m: isinstance(m, ExitedEvent))
        assert isinstance(exited, ExitedEvent) and exited.record.exit_code == 0
        assert (directory / EXIT_FILE).exists() and "late" not in spool_text(directory)
        late = control.request(encode_stdin(0, b"y"))
        assert (late.ok, late.code) == (False, "not_running")
        control.until(lambda m: isinstance(m, EndedEvent))
    assert spool_text(directory) == "early\nlate\n"
    last = [e for e in control.events if isinstance(e, OutputEvent) and e.stream == "stdout"][-1]
    assert last.total == len("early\nlate\n")


def test_a_spawn_failure_is_a_typed_error_and_nothing_ran(holder_dir):
    directory = holder_dir()
    with pytest.raises(HolderLaunchError) as missing:
        launch_holder(directory, spec(["/nonexistent/program"]))
    assert missing.value.code == "spawn_failed" and "exec" in missing.value.message
    assert not (directory / EXIT_FILE).exists() and not (directory / CONTROL_SOCKET).exists()
    other = holder_dir()
    with pytest.raises(HolderLaunchError) as bad_cwd:
        launch_holder(other, spec(["true"], cwd="/nonexistent-directory"))
    assert bad_cwd.value.code == "spawn_failed" and "cwd" in bad_cwd.value.message
    with pytest.raises(HolderLaunchError) as twice:
        launch_holder(other, spec(["true"]))
    assert twice.value.code == "holder_exists"


def test_a_spec_the_holder_refuses_is_a_typed_error(holder_dir):
    directory = holder_dir()
    with pytest.raises(HolderLaunchError) as refused:
        launch_holder(directory, spec([]))
    assert refused.value.code == "bad_spec" and "argv" in refused.value.message


def test_a_directory_that_cannot_be_written_is_a_typed_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(HolderLaunchError) as failed:
        launch_holder(blocker / "spool", spec(["true"]))  # a path through a regular file
    assert failed.value.code == "holder_failed"


def test_a_launch_past_its_deadline_is_abandoned_and_its_holder_killed(holder_dir):
    directory = holder_dir()
    with pytest.raises(HolderLaunchError) as late:
        launch_holder(directory, spec(["sleep", "30"], stdin="null"), timeout_s=0.001)
    assert late.value.code == "holder_timeout"
    # The holder was in the starter's group, killed with it: nothing can start later.
    wait_until(lambda: not processes_naming(directory), "the starter and its holder to be gone")
    assert not (directory / "holder.json").exists()


# --- stdin ---------------------------------------------------------------------------------


def test_a_prompt_is_answered_through_stdin(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh('printf "name? "; read -r name; echo "hello $name"'))
    with Control(directory) as control:
        assert control.request(encode_watch()).ok
        control.output_total("stdout", len("name? "))
        assert control.request(encode_stdin(0, b"world\n")).fields["next"] == 6
        control.until(lambda m: isinstance(m, EndedEvent))
    assert spool_text(directory) == "name? hello world\n"


def test_stdin_offsets_retries_overlaps_gaps_and_close(holder_dir):
    directory = holder_dir()
    # Lives on after cat's end-of-file, so that the holder can be asked about a closed stdin.
    launch_holder(directory, sh("cat; echo; echo eof; sleep 30"))
    with Control(directory) as control:
        assert control.request(encode_stdin(0, b"abc")).fields["next"] == 3
        assert control.request(encode_stdin(0, b"abc")).fields["next"] == 3  # a retry: not again
        assert control.request(encode_stdin(1, b"bcdef")).fields["next"] == 6  # only "def" is new
        gap = control.request(encode_stdin(10, b"xyz"))
        assert (gap.ok, gap.code, gap.fields["expected"]) == (False, "stdin_gap", 6)
        early = control.request(encode_close_stdin(3))
        assert (early.code, early.fields["expected"]) == ("stdin_gap", 6)
        assert control.request(encode_close_stdin(6)).ok
        assert control.request(encode_close_stdin(6)).ok  # idempotent
        wait_until(lambda: "eof" in spool_text(directory), "cat to see end-of-file")
        assert control.request(encode_stdin(0, b"abcdef")).fields["next"] == 6  # a late retry: acknowledged
        after = control.request(encode_stdin(6, b"more"))
        assert (after.ok, after.code) == (False, "stdin_closed")
        assert control.request(encode_terminate()).ok
        wait_for_exit(directory)
    wait_for_end(directory)
    assert spool_text(directory) == "abcdef\neof\n"


def test_stdin_is_bounded_for_a_process_that_never_reads(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"]))
    offered = 300 * 1024
    with Control(directory) as control:
        # Each write takes what fits, then the rest is sent from `next`, as a client does,
        # until nothing more is taken: the buffer and the pipe are full.
        accepted, previous = 0, -1
        while accepted != previous:
            previous = accepted
            reply = control.request(encode_stdin(accepted, b"x" * min(offered - accepted, 150 * 1024)))
            accepted = reply.fields["next"]
        assert DEFAULT_STDIN_BUFFER_BYTES <= accepted <= DEFAULT_STDIN_BUFFER_BYTES + PIPE_CAPACITY
        assert control.request(encode_terminate()).ok
        record = wait_for_exit(directory)
    assert record.signal == "SIGTERM"


# --- terminals -----------------------------------------------------------------------------


def test_a_pty_process_sees_a_terminal_and_one_stream(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("test -t 0 && test -t 1 && echo terminal; echo err >&2", pty=TerminalSize(24, 80)))
    wait_for_exit(directory)
    wait_for_end(directory)
    assert spool_text(directory) == "terminal\r\nerr\r\n"  # the line discipline's newline
    assert not (directory / "stderr").exists()


def test_stty_size_follows_resize(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("stty size; read -r x; stty size", pty=TerminalSize(24, 80)))
    with Control(directory) as control:
        assert control.request(encode_watch()).ok
        wait_until(lambda: "24 80" in spool_text(directory), "the first size")
        assert control.request(encode_resize(40, 100)).ok
        assert control.request(encode_stdin(0, b"\n")).ok
        control.until(lambda m: isinstance(m, EndedEvent))
    assert re.fullmatch(r"24 80\r\n\r\n40 100\r\n", spool_text(directory))


def test_resize_without_a_terminal_is_refused(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"]))
    with Control(directory) as control:
        reply = control.request(encode_resize(40, 100))
        assert (reply.ok, reply.code) == (False, "not_a_terminal")
        assert control.request(encode_terminate()).ok


def test_ctrl_c_on_the_terminal_interrupts_the_foreground_process(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"], pty=TerminalSize(24, 80)))
    with Control(directory) as control:
        assert control.request(encode_stdin(0, b"\x03")).ok
        record = wait_for_exit(directory)
    assert (record.exit_code, record.signal, record.timed_out) == (None, "SIGINT", False)


def test_close_stdin_on_a_terminal_sends_end_of_file(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["cat"], pty=TerminalSize(24, 80)))
    with Control(directory) as control:
        assert control.request(encode_stdin(0, b"partial")).ok
        assert control.request(encode_close_stdin(7)).ok
        record = wait_for_exit(directory)
    assert record.exit_code == 0
    wait_for_end(directory)
    assert spool_text(directory) == "partialpartial"  # the echo, then cat's copy


# --- detached life ---------------------------------------------------------------------------


LAUNCH_AND_LINGER = """
import json, sys, time
from sandbox_supervisor.daemon.runtime.holder_launch import launch_holder
from sandbox_supervisor.daemon.runtime.holder_protocol import HolderSpec
info = launch_holder(sys.argv[1], HolderSpec(argv=("cat",), cwd="/", env={}))
print(json.dumps(info.to_json()), flush=True)
time.sleep(60)
"""


def test_the_holder_survives_the_death_of_its_launcher(holder_dir):
    directory = holder_dir()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH_AND_LINGER, str(directory)], stdout=subprocess.PIPE)
    try:
        assert launcher.stdout is not None
        info = HolderInfo(**json.loads(launcher.stdout.readline()))
    finally:
        launcher.kill()
        launcher.wait()
    assert alive(info.holder_pid) and alive(info.pid)
    # Detached: not the launcher's child, not in its session, and not in the test's.
    assert os.getsid(info.holder_pid) not in {os.getsid(0), launcher.pid}
    assert os.getsid(info.pid) == info.pid == info.pgid
    holder_status = Path(f"/proc/{info.holder_pid}/status").read_text()
    assert re.search(rf"^PPid:\s+(?!{launcher.pid}\b)\d+$", holder_status, re.MULTILINE)
    with Control(directory) as control:
        assert control.request(encode_watch()).ok
        assert control.request(encode_stdin(0, b"still here\n")).ok
        control.output_total("stdout", len("still here\n"))
        assert control.request(encode_close_stdin(11)).ok
        control.until(lambda m: isinstance(m, EndedEvent))
    assert spool_text(directory) == "still here\n"


def test_a_new_connection_replaces_the_old_one_and_watch_continues_from_the_spool(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["cat"]))
    first = Control(directory)
    assert first.request(encode_watch()).ok
    assert first.request(encode_stdin(0, b"one\n")).ok
    first.output_total("stdout", 4)
    with Control(directory) as second:
        with pytest.raises(EOFError):
            first.until(lambda m: False)  # the holder hung up on the old client
        first.close()
        assert second.request(encode_watch()).ok
        resumed = second.until(lambda m: isinstance(m, OutputEvent) and m.stream == "stdout")
        assert isinstance(resumed, OutputEvent) and resumed.total == 4  # where the spool is
        assert second.request(encode_stdin(4, b"two\n")).fields["next"] == 8
        second.output_total("stdout", 8)
        assert second.request(encode_close_stdin(8)).ok
        second.until(lambda m: isinstance(m, EndedEvent))
    assert spool_text(directory) == "one\ntwo\n"


# --- timeouts and signals ------------------------------------------------------------------


def test_a_timeout_terminates_then_kills_after_the_grace(holder_dir):
    directory = holder_dir()
    started = time.monotonic()
    launch_holder(directory, sh("trap '' TERM; sleep 30", stdin="null", timeout_s=0.3, kill_grace_s=0.3))
    record = wait_for_exit(directory)
    assert (record.exit_code, record.signal, record.timed_out) == (None, "SIGKILL", True)
    assert 600 <= record.duration_ms and time.monotonic() - started < WAIT_S


def test_a_timeout_ends_a_process_that_obeys_sigterm(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"], stdin="null", timeout_s=0.2))
    record = wait_for_exit(directory)
    assert (record.exit_code, record.signal, record.timed_out) == (None, "SIGTERM", True)


def test_terminate_kills_after_the_grace_and_is_not_a_timeout(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("trap '' TERM; echo ready; sleep 30", stdin="null", kill_grace_s=0.2))
    # Terminated only once the trap is set: a SIGTERM before it ends the shell at once.
    wait_until(lambda: spool_text(directory) == "ready\n", "the trap")
    with Control(directory) as control:
        assert control.request(encode_terminate()).ok
        record = wait_for_exit(directory)
    assert (record.signal, record.timed_out) == ("SIGKILL", False)


def test_signal_reaches_the_process_group(holder_dir):
    directory = holder_dir()
    # The shell waits for sleep, which is in its group: SIGUSR1 to the group ends both.
    launch_holder(directory, sh("sleep 30; echo not reached", stdin="null"))
    with Control(directory) as control:
        bad = control.request(encode_signal("NOPE"))
        assert (bad.ok, bad.code) == (False, "bad_request")
        reply = control.request(encode_signal("SIGUSR1"))
        assert reply.ok and reply.fields["delivered"] is True
        record = wait_for_exit(directory)
    assert record.signal == "SIGUSR1"
    wait_for_end(directory)
    assert spool_text(directory) == ""


def test_bad_requests_get_typed_errors_and_the_connection_goes_on(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"], stdin="null"))
    with Control(directory) as control:
        for line, code in [
            (b"not json\n", "bad_request"),
            (b"[1]\n", "bad_request"),
            (b'{"op":"dance"}\n', "unknown_op"),
            (b'{"op":"stdin","offset":-1,"data":""}\n', "bad_request"),
            (b'{"op":"stdin","offset":0,"data":"!!"}\n', "bad_request"),
        ]:
            reply = control.request(line)
            assert (reply.ok, reply.code) == (False, code), line
        null_stdin = control.request(encode_stdin(0, b"x"))
        assert (null_stdin.ok, null_stdin.code) == (False, "stdin_closed")
        assert control.request(encode_terminate()).ok


def test_a_line_over_the_limit_is_answered_then_the_connection_is_closed(holder_dir):
    directory = holder_dir()
    launch_holder(directory, spec(["sleep", "30"], stdin="null"))
    with Control(directory) as control:
        reply = control.request(b"x" * (MAX_LINE_BYTES + 1))
        assert (reply.ok, reply.code) == (False, "line_too_long")
        with pytest.raises(EOFError):
            control.until(lambda m: False)
    with Control(directory) as control:  # the holder itself goes on
        assert control.request(encode_terminate()).ok
    assert wait_for_exit(directory).signal == "SIGTERM"


# --- identity, OOM score, cgroup -------------------------------------------------------------


@needs_root
def test_the_command_runs_as_the_spec_user_while_the_holder_stays_root(holder_dir):
    directory = holder_dir()
    script = "id -u; id -g; id -G; cat /proc/self/oom_score_adj; read -r x"
    info = launch_holder(directory, sh(script, uid=NOBODY, gid=NOBODY, groups=None, oom_score_adj=100))
    with Control(directory) as control:
        wait_until(lambda: spool_text(directory).count("\n") == 4, "the ids")
        holder_uids = re.search(r"^Uid:\s+(.*)$", Path(f"/proc/{info.holder_pid}/status").read_text(), re.MULTILINE)
        assert holder_uids is not None and holder_uids.group(1).split() == ["0"] * 4
        assert control.request(encode_stdin(0, b"\n")).ok
        wait_for_exit(directory)
    # No supplementary group leaks from root: with groups=None, only the primary group.
    assert spool_text(directory) == f"{NOBODY}\n{NOBODY}\n{NOBODY}\n100\n"


@needs_root
def test_explicit_supplementary_groups_are_set(holder_dir):
    directory = holder_dir()
    launch_holder(directory, sh("id -G", stdin="null", uid=NOBODY, gid=NOBODY, groups=(NOBODY, 4242)))
    wait_for_exit(directory)
    wait_for_end(directory)
    assert sorted(spool_text(directory).split()) == sorted([str(NOBODY), "4242"])


@pytest.fixture
def cgroup2(tmp_path) -> Iterator[Path]:
    """A private cgroup2 mount (root only), with one child cgroup for the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting cgroup2 needs root (CI runs as root)")
    mount = tmp_path / "cgroup2"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "cgroup2", "none", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount cgroup2 here: {done.stderr.decode().strip()}")
    child = mount / f"holder-test-{uuid.uuid4().hex[:8]}"
    child.mkdir()
    try:
        yield child
    finally:
        if (child / "cgroup.kill").exists():
            (child / "cgroup.kill").write_text("1")
        wait_until(lambda: not (child / "cgroup.procs").read_text().strip(), "the cgroup to empty")
        child.rmdir()
        subprocess.run(["umount", str(mount)], check=True)


def test_the_process_is_put_in_the_spec_cgroup_before_exec(holder_dir, cgroup2):
    directory = holder_dir()
    info = launch_holder(directory, sh("cat /proc/self/cgroup; sleep 30", stdin="null", cgroup=str(cgroup2), uid=NOBODY, gid=NOBODY))
    assert str(info.pid) in (cgroup2 / "cgroup.procs").read_text().split()
    wait_until(lambda: "0::" in spool_text(directory), "the command's cgroup line")
    assert f"0::/{cgroup2.name}\n" in spool_text(directory)  # as the command itself saw it at start
    with Control(directory) as control:
        assert control.request(encode_terminate()).ok
        record = wait_for_exit(directory)
    assert record.signal == "SIGTERM"


def test_signals_reach_descendants_that_left_the_group_through_the_cgroup(holder_dir, cgroup2):
    directory = holder_dir()
    # The escaped sleep leads a session of its own: killpg of the command's group misses it.
    launch_holder(directory, sh("setsid sleep 30 & echo $!; exec sleep 30", stdin="null", cgroup=str(cgroup2)))
    wait_until(lambda: spool_text(directory).strip().isdigit(), "the escaped pid")
    escaped = int(spool_text(directory))
    # `$!` is known before the background child has run setsid: wait for its own session.
    wait_until(lambda: os.getsid(escaped) == escaped, "the escaped process to lead a session")
    assert alive(escaped)
    with Control(directory) as control:
        assert control.request(encode_signal("SIGTERM")).fields["delivered"] is True
        wait_for_exit(directory)
    wait_until(lambda: not alive(escaped), "the escaped process to be signalled")
    wait_for_end(directory)  # its end closed the last copy of stdout


def test_a_cgroup_the_holder_cannot_enter_fails_the_spawn(holder_dir, tmp_path):
    directory = holder_dir()
    with pytest.raises(HolderLaunchError) as failed:
        launch_holder(directory, spec(["true"], cgroup=str(tmp_path / "no-such-cgroup")))
    assert failed.value.code == "spawn_failed" and "cgroup" in failed.value.message
