"""The systemd units (checked by systemd itself and against the daemon's own numbers), the
example configuration they start the daemon with, `install-units` (which writes exactly these
files), sd_notify and the watchdog interval, and the OOM-score wrapper for commands."""

from __future__ import annotations

import json
import os
import pwd
import tomllib
from contextlib import nullcontext
import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.app import STOP_COMPLETION_BUDGET_S
from sandbox_supervisor.daemon.ops import cli
from sandbox_supervisor.daemon.exits import EXIT_CONFIG, EXIT_TERMINATED
from sandbox_supervisor.daemon.config import ConfigError, ExecConfig, WebSocketConfig, load_config, parse_host_port
from sandbox_supervisor.daemon.ops.notify import SystemdNotifier, send_watchdog_pings, watchdog_interval_s
from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ, SUPERVISOR_OOM_SCORE_ADJ

REPO = Path(__file__).resolve().parents[1]
UNIT_DIR = REPO / "systemd"
SERVICE = UNIT_DIR / "sandbox-supervisor.service"
UNIX_SOCKET_UNIT = UNIT_DIR / "sandbox-supervisor.socket"
TCP_SOCKET_UNIT = UNIT_DIR / "sandbox-supervisor-tcp.socket"
EXAMPLE_CONFIG = UNIT_DIR / "supervisor.toml"
UNIT_FILES = (SERVICE, UNIX_SOCKET_UNIT, TCP_SOCKET_UNIT)
ENTRY = "/opt/sandbox-supervisor/venv/bin/sandbox-supervisor"
EXEC_START = f"{ENTRY} serve --config /etc/sandbox-supervisor/supervisor.toml"
E2B_PORTS = {49983, 49999}


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value given (systemd allows repeated keys)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}: expected one value, got {values}"
    return values[0]


def seconds(timespan: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|min)?", timespan)
    assert match, f"unsupported timespan {timespan!r}"
    factor = {"ms": 0.001, "s": 1.0, "min": 60.0, None: 1.0}[match.group(2)]
    return int(match.group(1)) * factor


# --- systemd's own verdict ---------------------------------------------------------------


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail(
            "systemd-analyze is not installed: apt-get install -y systemd "
            "(.ci/run installs it; the units must be checked, not skipped)"
        )
    # `verify` insists that ExecStart's program exists and is executable, and /opt/... exists
    # only inside a sandbox image. It also resolves units named by Service= from the
    # directory of the files it is given. So: verify copies side by side, with ExecStart
    # pointed at a stand-in executable; every other line is checked exactly as shipped.
    stand_in = tmp_path / "bin" / "sandbox-supervisor"
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    copies = []
    for unit in UNIT_FILES:
        text = unit.read_text()
        if unit == SERVICE:
            assert text.count(ENTRY) == 1, "ExecStart must name the venv's console script once"
            text = text.replace(ENTRY, str(stand_in))
        copy = tmp_path / unit.name
        copy.write_text(text)
        copies.append(str(copy))
    completed = subprocess.run(
        [tool, "verify", *copies],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    # Unknown keys and bad values are only warnings (exit 0): any output is a failure.
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout + completed.stderr == ""


# --- the service against the daemon's own numbers ----------------------------------------


def test_service_is_a_notify_daemon_with_watchdog_reload_and_restart_policy() -> None:
    unit = parse_unit(SERVICE)
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "ExecStart") == EXEC_START
    assert one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert seconds(one(unit, "Service", "WatchdogSec")) > 0
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "RestartPreventExitStatus").split() == [str(EXIT_TERMINATED)]
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


# The longest stall of the daemon's event loop (I/O or memory pressure, a short SIGSTOP) the
# unit must ride out, and how soon a hung loop must still be replaced (docs/operations.md,
# "The daemon stopped: SIGSTOP, a frozen cgroup, a debugger").
TOLERATED_STALL_S = 30.0
HANG_REPLACED_WITHIN_S = 60.0


def test_watchdog_rides_out_a_stall_and_still_replaces_a_hung_daemon() -> None:
    unit = parse_unit(SERVICE)
    watchdog_s = seconds(one(unit, "Service", "WatchdogSec"))
    # The daemon's own ping interval for that timeout. In the worst case a stall begins just
    # before a ping was due, so systemd sees the stall plus one interval.
    interval_s = watchdog_interval_s({"WATCHDOG_USEC": str(int(watchdog_s * 1_000_000))})
    assert interval_s is not None
    assert watchdog_s - interval_s >= TOLERATED_STALL_S
    assert watchdog_s <= HANG_REPLACED_WITHIN_S


def test_the_restart_policy_never_gives_up_after_a_passing_fault() -> None:
    """A start limit would leave the sandbox without a supervisor once a passing fault (a full
    disk, a JWKS file provisioned late) had made it restart often enough, and nothing would
    start it again when the fault is gone: the rate limit is off, and RestartSec paces."""
    unit = parse_unit(SERVICE)
    assert one(unit, "Unit", "StartLimitIntervalSec") == "0"
    assert "StartLimitBurst" not in unit["Unit"]  # meaningless without an interval
    assert 0 < seconds(one(unit, "Service", "RestartSec")) <= 5


def test_a_refused_state_exit_2_is_restarted_as_any_exit_2() -> None:
    """Exit 2 is also a passing fault's (a JWKS file provisioned late): preventing its restart
    would leave the sandbox without a supervisor once that fault is gone. A refused state
    (exit 2, supervisor.state_refused) is refused again at each restart, never started on;
    the unit comment and docs/operations.md say so."""
    unit = parse_unit(SERVICE)
    assert str(EXIT_CONFIG) not in one(unit, "Service", "RestartPreventExitStatus").split()
    text = SERVICE.read_text()
    assert "RestartPreventExitStatus" in text and "state_refused" in text


def test_stop_timeout_covers_the_kill_grace_and_the_drain() -> None:
    unit = parse_unit(SERVICE)
    # SIGTERM to the daemon alone, and nothing else from systemd: held processes outlive a
    # restart that keeps them (the daemon ends them itself on a stop).
    assert one(unit, "Service", "KillMode") == "process"
    grace_s = ExecConfig().kill_grace_ms / 1000
    # The drain budget is spent twice: sending each socket what is journaled, then the close
    # handshakes (docs/protocol.md §10.1).
    stop_s = grace_s + STOP_COMPLETION_BUDGET_S + 2 * WebSocketConfig().drain_budget_s
    # Twice the daemon's own stop sequence, so a slow disk does not turn a clean stop into
    # a SIGKILL of the daemon.
    assert seconds(one(unit, "Service", "TimeoutStopSec")) >= 2 * stop_s


def test_the_unit_delegates_its_cgroup_so_each_command_gets_one() -> None:
    """Delegate=yes hands the unit's cgroup subtree to the daemon (runtime/cgroups.py picks it
    as its cgroup2 root in auto mode, systemd marking it with the trusted.delegate xattr)."""
    unit = parse_unit(SERVICE)
    assert one(unit, "Service", "Delegate") == "yes"


def test_state_and_runtime_directories_are_private() -> None:
    unit = parse_unit(SERVICE)
    assert one(unit, "Service", "StateDirectory") == "sandbox-supervisor"
    assert one(unit, "Service", "StateDirectoryMode") == "0700"
    assert one(unit, "Service", "RuntimeDirectory") == "sandbox-supervisor"
    assert one(unit, "Service", "RuntimeDirectoryMode") == "0700"
    # The activated unix socket lives there and belongs to the socket unit.
    assert one(unit, "Service", "RuntimeDirectoryPreserve") == "yes"


def test_daemon_is_protected_from_the_oom_killer_and_commands_are_not() -> None:
    unit = parse_unit(SERVICE)
    assert int(one(unit, "Service", "OOMScoreAdjust")) == SUPERVISOR_OOM_SCORE_ADJ
    assert -1000 < SUPERVISOR_OOM_SCORE_ADJ < 0  # protected, yet killable
    assert COMMAND_OOM_SCORE_ADJ > 0  # commands go before the sandbox's own services
    # An OOM-killed command must not stop the unit (and with it the daemon).
    assert one(unit, "Service", "OOMPolicy") == "continue"


def test_hardening_that_would_break_agent_commands_is_off() -> None:
    unit = parse_unit(SERVICE)
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices"):
        assert one(unit, "Service", key) == "no", key
    for key in ("SystemCallFilter", "RestrictSUIDSGID", "CapabilityBoundingSet", "RemoveIPC"):
        assert key not in unit["Service"] or unit["Service"][key] == ["no"], key


def test_every_setting_of_the_service_says_why() -> None:
    """Each [Service] setting sits under a comment (directly, or as part of a group of
    settings under one comment) — the unit is where an operator looks for the reasons."""
    lines = SERVICE.read_text().splitlines()
    section = None
    explained = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
            explained = False
        elif stripped.startswith("#"):
            explained = True
        elif not stripped:
            explained = False
        elif section == "[Service]" and stripped.split("=")[0] not in ("ExecStart",):
            assert explained, f"no comment explains {stripped!r}"


# --- the socket units ---------------------------------------------------------------------


def test_socket_units_name_their_sockets_and_feed_the_one_service() -> None:
    unix_unit = parse_unit(UNIX_SOCKET_UNIT)
    tcp_unit = parse_unit(TCP_SOCKET_UNIT)
    names = [one(unix_unit, "Socket", "FileDescriptorName"), one(tcp_unit, "Socket", "FileDescriptorName")]
    assert len(set(names)) == 2 and all(re.fullmatch(r"[a-z-]+", n) for n in names)
    # The unix unit matches the service by name; the TCP unit names it.
    assert UNIX_SOCKET_UNIT.stem == SERVICE.stem
    assert one(tcp_unit, "Socket", "Service") == SERVICE.name
    assert one(unix_unit, "Socket", "SocketMode") == "0600"  # as the daemon's own sockets
    service = parse_unit(SERVICE)
    # The daemon runs as root (no User=) and commands as `[exec] user`: the socket is root's,
    # so the agent's commands can neither connect to it nor replace it.
    assert "User" not in service["Service"] and "Group" not in service["Service"]
    assert one(unix_unit, "Socket", "SocketUser") == "root"
    assert one(unix_unit, "Socket", "SocketGroup") == "root"
    for unit in (unix_unit, tcp_unit):
        assert unit["Socket"].get("Accept", ["no"]) == ["no"]  # listening sockets, not connections
        assert one(unit, "Install", "WantedBy") == "sockets.target"


def test_example_config_separates_the_agent_from_the_daemon() -> None:
    """The shipped setup: commands as E2B's `user` with no extra groups (docs/operations.md,
    "Privilege separation"). Validating it needs that account, which a CI machine lacks."""
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    assert raw["exec"] == {"user": "user", "group": "user", "supplementary_groups": []}
    with pytest.raises(ConfigError, match="exec") if not _has_user("user") else nullcontext():
        load_config(EXAMPLE_CONFIG, env={})


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def test_example_config_validates_and_matches_the_units() -> None:
    # Any existing account stands in for E2B's `user` (see the test above).
    config = load_config(EXAMPLE_CONFIG, env={}, overrides={"exec.user": "nobody", "exec.group": "nogroup"})
    service = parse_unit(SERVICE)
    unix_path = one(parse_unit(UNIX_SOCKET_UNIT), "Socket", "ListenStream")
    tcp_address = one(parse_unit(TCP_SOCKET_UNIT), "Socket", "ListenStream")
    # With or without socket activation, the daemon serves the same addresses.
    assert config.listen.unix == [unix_path]
    assert config.listen.tcp == [tcp_address]
    assert parse_host_port(tcp_address)[1] not in E2B_PORTS
    runtime_dir = "/run/" + one(service, "Service", "RuntimeDirectory")
    assert Path(unix_path).parent == Path(runtime_dir)
    assert config.paths.state_dir == Path("/var/lib") / one(service, "Service", "StateDirectory")
    config_dir = Path("/etc") / one(service, "Service", "ConfigurationDirectory")
    assert config.authority.jwks_file.parent == config_dir
    assert EXEC_START.endswith(str(config_dir / EXAMPLE_CONFIG.name))
    assert config.websocket.metrics_enabled is False
    assert config.logging.format == "json"


# --- install-units: the same files, written where systemd and the unit look -------------

INSTALLED_UNIT_DIR = Path("etc/systemd/system")
INSTALLED_CONFIG = Path("etc/sandbox-supervisor/supervisor.toml")
CLI_TIMEOUT_S = 60


def install_units(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["install-units", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_install_units_writes_the_verified_units_and_the_example_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_umask = os.umask(0o077)  # image builds may run with a strict umask: modes must not follow it
    try:
        code, out, err = install_units(capsys, "--root", str(tmp_path))
    finally:
        os.umask(old_umask)
    assert (code, err) == (0, "")
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted([INSTALLED_CONFIG, *(INSTALLED_UNIT_DIR / unit.name for unit in UNIT_FILES)])
    for unit in UNIT_FILES:  # byte for byte what the tests above verify
        assert (tmp_path / INSTALLED_UNIT_DIR / unit.name).read_bytes() == unit.read_bytes()
    assert (tmp_path / INSTALLED_CONFIG).read_bytes() == EXAMPLE_CONFIG.read_bytes()
    for path in tmp_path.rglob("*"):
        expected = 0o755 if path.is_dir() else 0o644
        assert path.stat().st_mode & 0o777 == expected, path
    # The config lands where ExecStart reads it; the report names every file it wrote.
    assert EXEC_START.endswith("/" + str(INSTALLED_CONFIG))
    assert sorted(out.splitlines()) == sorted(f"wrote {tmp_path / path}" for path in written)


def test_install_units_replaces_units_and_keeps_an_existing_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert install_units(capsys, "--root", str(tmp_path))[0] == 0
    service = tmp_path / INSTALLED_UNIT_DIR / SERVICE.name
    config = tmp_path / INSTALLED_CONFIG
    service.write_text("[Service]\nExecStart=/bin/false\n")
    config.write_text("# the operator's own\n")
    code, out, _ = install_units(capsys, "--root", str(tmp_path))
    assert code == 0
    assert service.read_bytes() == SERVICE.read_bytes()  # units belong to the release
    assert config.read_text() == "# the operator's own\n"  # the configuration to the operator
    assert f"kept {config} (it exists; --force replaces it)" in out.splitlines()
    code, out, _ = install_units(capsys, "--root", str(tmp_path), "--force")
    assert code == 0
    assert config.read_bytes() == EXAMPLE_CONFIG.read_bytes()
    assert f"wrote {config}" in out.splitlines()


def test_install_units_replaces_a_masked_unit_instead_of_writing_through_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `systemctl mask` is a symlink to /dev/null; here, to a file we can watch.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched\n")
    unit_dir = tmp_path / "root" / INSTALLED_UNIT_DIR
    unit_dir.mkdir(parents=True)
    (unit_dir / SERVICE.name).symlink_to(elsewhere)
    assert install_units(capsys, "--root", str(tmp_path / "root"))[0] == 0
    assert not (unit_dir / SERVICE.name).is_symlink()
    assert (unit_dir / SERVICE.name).read_bytes() == SERVICE.read_bytes()
    assert elsewhere.read_text() == "untouched\n"
    assert [p.name for p in unit_dir.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_install_units_refuses_a_bad_root_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-root"
    code, out, err = install_units(capsys, "--root", str(missing))
    assert (code, out) == (2, "")
    assert err == f"sandbox-supervisor: --root {missing} is not a directory\n"
    assert not missing.exists()
    # A file where a directory must go: the file system's refusal, named, not a traceback.
    (tmp_path / "etc").write_text("a file\n")
    code, out, err = install_units(capsys, "--root", str(tmp_path))
    assert (code, out) == (2, "")
    assert err.startswith(f"sandbox-supervisor: cannot write {tmp_path / INSTALLED_UNIT_DIR}/")
    # --force cannot replace a directory standing where the configuration goes.
    other = tmp_path / "other"
    (other / INSTALLED_CONFIG).mkdir(parents=True)
    code, _, err = install_units(capsys, "--root", str(other), "--force")
    assert code == 2 and err.startswith(f"sandbox-supervisor: cannot write {other / INSTALLED_CONFIG}:")


def test_install_units_runs_as_the_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "sandbox-supervisor"
    completed = subprocess.run(
        [str(script), "install-units", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / INSTALLED_CONFIG).read_bytes() == EXAMPLE_CONFIG.read_bytes()
    assert len(completed.stdout.splitlines()) == len(UNIT_FILES) + 1


# --- sd_notify and the watchdog interval -------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "20000000"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "{pid}"}, 10.0),
        ({"WATCHDOG_USEC": "3"}, 1.5e-6),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "{other}"}, None),  # for another process
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "abc"}, None),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "0"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "18446744073709551615"}, None),  # USEC_INFINITY: no timeout
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "+5"}, None),
        ({"WATCHDOG_USEC": " 5"}, None),
        ({"WATCHDOG_USEC": "5s"}, None),
        ({"WATCHDOG_PID": "{pid}"}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_our_pid(env: dict, expected) -> None:
    pid = 4242
    filled = {k: v.format(pid=pid, other=pid + 1) for k, v in env.items()}
    assert watchdog_interval_s(filled, pid=pid) == expected


def test_watchdog_pid_defaults_to_our_own_pid() -> None:
    env = {"WATCHDOG_USEC": "8000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(env) == 4.0
    assert watchdog_interval_s({**env, "WATCHDOG_PID": str(os.getpid() + 1)}) is None


def _datagram_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_sends_one_datagram_to_a_socket_path(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with _datagram_socket(str(path)) as receiver:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.enabled
        assert notifier.notify("READY=1", "STATUS=serving") is True
        assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_maps_an_at_sign_to_the_abstract_namespace() -> None:
    name = f"sandbox-supervisor-test-{uuid.uuid4().hex}"
    with _datagram_socket("\0" + name) as receiver:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.notify("WATCHDOG=1") is True
        assert receiver.recv(4096) == b"WATCHDOG=1"


def test_notify_outside_systemd_or_to_a_missing_socket_is_a_quiet_no(tmp_path: Path) -> None:
    assert SystemdNotifier({}).enabled is False
    assert SystemdNotifier({}).notify("READY=1") is False
    gone = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    assert gone.notify("READY=1") is False  # best effort: never raises


async def test_watchdog_pings_at_the_interval(tmp_path: Path, autojump_clock) -> None:
    path = tmp_path / "watchdog.sock"
    with _datagram_socket(str(path)) as receiver:
        receiver.setblocking(False)
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
        with trio.move_on_after(25):  # virtual time: pings at 0, 10 and 20 s
            await send_watchdog_pings(notifier, 10.0)
        received = []
        while True:
            try:
                received.append(receiver.recv(4096))
            except BlockingIOError:
                break
        assert received == [b"WATCHDOG=1"] * 3
