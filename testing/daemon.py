"""Start a real supervisor on temporary directories, for this project's tests and for yours.

Two ways to run one, on the same on-disk layout (a state dir, a workspace, a sandbox-id file,
a JWKS file from a `LoopbackAuthority`, a unix socket and a TCP port 0 on loopback; see
`make_layout`):

- `in_process_daemon(layout)`: the supervisor inside the caller's trio loop (fast; the
  `RunningDaemon` it yields also carries the assembled `Daemon` (`app.Daemon`), to look at its state).
- `running_daemon(layout)`: `python -m sandbox_supervisor.daemon serve --config …` in a
  subprocess, as users start it, with its JSON log in `layout.log_file`. It yields the
  started `DaemonProcess`, and on leaving always stops it (SIGTERM, then SIGKILL if it has
  not exited within `stop_timeout`), whatever the body raised::

      layout = make_layout(tmp_path / "d", authority=LoopbackAuthority())
      async with running_daemon(layout) as process:
          async with process.running.client().connect() as session:
              await session.bootstrap(cwd=str(layout.workspace))
      assert process.returncode == 0  # the exit status of the stop on leaving

  The body may signal, kill, wait for and `start()` the same process again; the stop on
  leaving is for whichever run is current, and does nothing if it has already exited. With
  `wait_ready=False` the body gets the process as soon as it is spawned (for a daemon
  expected to exit at once, or to wait for `READY=1` yourself). A daemon that exits before
  listening raises `DaemonExitedEarly` (with its exit status and log); one whose stop times
  out is killed and raises `DaemonStopTimeout` (unless the body's own exception is already
  on its way out, which then is the one you see). A run whose log holds a crash the daemon
  contained (`BUG_EVENTS`: a connection's or socket's handler failed) raises
  `DaemonLoggedBug` on leaving: the body passed, but the daemon hid a bug from it.

Use `DaemonProcess` by hand only for what these do not cover.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import trio

from sandbox_supervisor.testing._groups import single_leaf
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.client import ControlClient, Endpoint

if TYPE_CHECKING:  # the daemon is imported where it is started, not with the client
    from sandbox_supervisor.daemon.app import Daemon
    from sandbox_supervisor.daemon.config import SupervisorConfig
    from sandbox_supervisor.daemon.edge.server import BoundListeners

DEFAULT_SANDBOX_ID = "sbx-test-0001"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0  # SIGTERM to exit; past it the daemon is killed
KILL_TIMEOUT_S = 10.0  # SIGKILL to reaped (only a process stuck in the kernel takes long)
LISTENING_FILE = "listening.json"
LOG_FILE = "daemon.log"


class DaemonExitedEarly(RuntimeError):
    """The daemon exited before it was listening (a bad configuration, a port in use …)."""

    def __init__(self, returncode: int, log: str) -> None:
        super().__init__(f"daemon exited with {returncode} before listening:\n{log}")
        self.returncode = returncode
        self.log = log


# Events the daemon logs only for a bug it contained (a crashed connection or socket handler):
# a test that saw one passed by luck, so leaving `running_daemon` fails on them.
BUG_EVENTS = frozenset({"connection.crashed", "socket.crashed"})


class DaemonLoggedBug(RuntimeError):
    """The daemon logged an event of BUG_EVENTS while it ran."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        super().__init__(f"the daemon logged {len(events)} contained crash(es); the first:\n{json.dumps(events[0], indent=1)}")
        self.events = events


class DaemonStopTimeout(RuntimeError):
    """The daemon did not exit within the stop timeout after SIGTERM (it was then killed)."""

    def __init__(self, timeout: float, log: str) -> None:
        super().__init__(f"daemon did not exit within {timeout} s of SIGTERM and was killed:\n{log}")
        self.log = log


@dataclass
class DaemonLayout:
    root: Path
    authority: LoopbackAuthority
    sandbox_id: str = DEFAULT_SANDBOX_ID
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # extra config by section

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def sandbox_id_file(self) -> Path:
        return self.root / "sandbox-id"

    @property
    def jwks_file(self) -> Path:
        return self.root / "jwks.json"

    @property
    def unix_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def config_file(self) -> Path:
        return self.root / "supervisor.toml"

    @property
    def log_file(self) -> Path:
        """Where a subprocess daemon's stderr (its JSON log) goes, appended run after run."""
        return self.root / LOG_FILE

    def config_dict(self) -> dict[str, dict[str, Any]]:
        config: dict[str, dict[str, Any]] = {
            "listen": {"tcp": ["127.0.0.1:0"], "unix": [str(self.unix_socket)]},
            "paths": {
                "state_dir": str(self.state_dir),
                "workspace_root": str(self.workspace),
                "sandbox_id_file": str(self.sandbox_id_file),
            },
            "authority": {
                "issuer": self.authority.issuer,
                "audience": self.authority.audience,
                "jwks_file": str(self.jwks_file),
            },
        }
        for section, values in self.settings.items():
            config.setdefault(section, {}).update(values)
        return config

    def config(self) -> SupervisorConfig:
        from sandbox_supervisor.daemon.config import SupervisorConfig

        return SupervisorConfig.model_validate(self.config_dict())

    def write_config(self) -> Path:
        self.config_file.write_text(_to_toml(self.config_dict()))
        return self.config_file


def make_layout(
    root: Path,
    *,
    authority: LoopbackAuthority | None = None,
    sandbox_id: str = DEFAULT_SANDBOX_ID,
    **settings: dict[str, Any],
) -> DaemonLayout:
    """Create the directories and files a daemon needs under `root`."""
    layout = DaemonLayout(root, authority or LoopbackAuthority(), sandbox_id, dict(settings))
    root.mkdir(parents=True, exist_ok=True)
    layout.workspace.mkdir(exist_ok=True)
    layout.sandbox_id_file.write_text(sandbox_id + "\n")
    layout.authority.write_jwks(layout.jwks_file)
    return layout


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _to_toml(config: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


@dataclass
class RunningDaemon:
    layout: DaemonLayout
    tcp: Endpoint
    unix: Endpoint
    supervisor: Daemon | None = None  # the in-process daemon's parts (None for a subprocess)

    def client(self, endpoint: Endpoint | None = None, **kwargs: str) -> ControlClient:
        kwargs.setdefault("sandbox_id", self.layout.sandbox_id)
        return ControlClient(endpoint or self.tcp, self.layout.authority, **kwargs)

    @property
    def endpoints(self) -> list[Endpoint]:
        return [self.tcp, self.unix]


def _endpoints(state_dir: Path) -> tuple[Endpoint, Endpoint]:
    listening = json.loads((state_dir / LISTENING_FILE).read_text())
    return Endpoint.parse(listening["tcp"][0]), Endpoint(unix=listening["unix"][0])


@asynccontextmanager
async def in_process_daemon(layout: DaemonLayout) -> AsyncIterator[RunningDaemon]:
    """Run the supervisor inside the caller's trio loop; stop it (exit 0) on leaving."""
    from sandbox_supervisor.daemon.app import EXIT_OK, run_supervisor

    result: dict[str, int] = {}

    async def run(
        task_status: trio.TaskStatus[tuple[Daemon, BoundListeners]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        result["exit"] = await run_supervisor(
            layout.config(), handle_signals=False, env={}, task_status=task_status
        )

    try:
        async with trio.open_nursery() as nursery:
            sup, bound = await nursery.start(run)
            tcp = Endpoint.parse(bound.tcp[0])
            daemon = RunningDaemon(layout, tcp, Endpoint(unix=bound.unix[0]), sup)
            try:
                yield daemon
            finally:
                sup.request_stop(EXIT_OK, "test finished")
    except BaseExceptionGroup as group:
        leaf = single_leaf(group)
        if leaf is not None:
            raise leaf from None
        raise


def _set_start_signals(ignored: tuple[int, ...], blocked: tuple[int, ...]) -> None:
    """In the daemon's child before its exec (a preexec_fn)."""
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)


class DaemonProcess:
    """`python -m sandbox_supervisor.daemon serve` in a subprocess, with its stderr (the JSON
    log) in `layout.log_file`. Prefer `running_daemon`, which always stops it."""

    def __init__(
        self,
        layout: DaemonLayout,
        *,
        env: dict[str, str] | None = None,
        ignored_signals: tuple[int, ...] = (),
        blocked_signals: tuple[int, ...] = (),
    ) -> None:
        self.layout = layout
        self.log_path = layout.log_file
        self.extra_env = env or {}
        # Signals the daemon starts with ignored, as a shell's background job (`&`: SIGINT,
        # SIGQUIT) or nohup (SIGHUP) starts it, or blocked: both survive exec.
        self.ignored_signals = ignored_signals
        self.blocked_signals = blocked_signals
        self.proc: subprocess.Popen[bytes] | None = None
        self._running: RunningDaemon | None = None
        self._log: BinaryIO | None = None

    @property
    def running(self) -> RunningDaemon:
        """The endpoints of the current run (known once `start()` saw it listening)."""
        if self._running is None:
            raise RuntimeError("the daemon was not started with wait_ready=True")
        return self._running

    @property
    def returncode(self) -> int | None:
        """The exit status of the current run, or None while it runs (or before a start)."""
        return None if self.proc is None else self.proc.poll()

    async def start(self, *, wait_ready: bool = True) -> RunningDaemon | None:
        config_file = self.layout.write_config()
        (self.layout.state_dir / LISTENING_FILE).unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_SUPERVISOR_")}
        env.pop("NOTIFY_SOCKET", None)
        env.update(self.extra_env)
        self._close_log()
        self._running = None
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox_supervisor.daemon", "serve", "--config", str(config_file)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=env,
            preexec_fn=(
                functools.partial(_set_start_signals, self.ignored_signals, self.blocked_signals)
                if self.ignored_signals or self.blocked_signals
                else None
            ),
        )
        if not wait_ready:
            return None
        with trio.fail_after(START_TIMEOUT_S):
            while not (self.layout.state_dir / LISTENING_FILE).exists():
                if (code := self.proc.poll()) is not None:
                    self._close_log()
                    raise DaemonExitedEarly(code, self.log_text())
                await trio.sleep(0.02)
        tcp, unix = _endpoints(self.layout.state_dir)
        self._running = RunningDaemon(self.layout, tcp, unix)
        return self._running

    def send_signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    async def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        assert self.proc is not None
        with trio.fail_after(timeout):
            while (code := self.proc.poll()) is None:
                await trio.sleep(0.01)
        self._close_log()
        return code

    async def kill(self) -> int:
        self.send_signal(signal.SIGKILL)
        return await self.wait(KILL_TIMEOUT_S)

    async def kill_and_start(self) -> RunningDaemon:
        """A crash and the restart after it: SIGKILL the current run, wait for its end, start
        the next one and wait until it listens; the new run's endpoints."""
        await self.kill()
        await self.start()
        return self.running

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit status (trio.TooSlowError past `timeout`); an
        exited run's status at once, 0 if none was started."""
        if self.proc is None:
            return 0
        if (code := self.proc.poll()) is not None:
            self._close_log()
            return code
        self.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for line in self.log_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


async def _stop_or_kill(process: DaemonProcess, timeout: float) -> bool:
    """Stop the current run; kill it if SIGTERM has not ended it within `timeout`. True if it
    stopped on its own. Shielded: a cancelled body must not leave the daemon running."""
    with trio.CancelScope(shield=True):
        try:
            await process.stop(timeout)
        except trio.TooSlowError:
            await process.kill()
            return False
    return True


@asynccontextmanager
async def running_daemon(
    layout: DaemonLayout,
    *,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    stop_timeout: float = STOP_TIMEOUT_S,
    ignored_signals: tuple[int, ...] = (),
    blocked_signals: tuple[int, ...] = (),
) -> AsyncIterator[DaemonProcess]:
    """Start `python -m sandbox_supervisor.daemon serve` on `layout` and yield the process; on
    leaving, stop whichever run is current (SIGTERM; SIGKILL past `stop_timeout`). `env` is
    added to the daemon's environment; `ignored_signals` are ignored and `blocked_signals`
    blocked when it starts. See the module docstring."""
    process = DaemonProcess(layout, env=env, ignored_signals=ignored_signals, blocked_signals=blocked_signals)
    try:
        await process.start(wait_ready=wait_ready)
        yield process
    except BaseException:
        await _stop_or_kill(process, stop_timeout)  # the body's exception is the one to see
        raise
    if not await _stop_or_kill(process, stop_timeout):
        raise DaemonStopTimeout(stop_timeout, process.log_text())
    if bugs := [event for event in process.log_events() if event.get("event") in BUG_EVENTS]:
        raise DaemonLoggedBug(bugs)
