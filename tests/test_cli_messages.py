"""What the command line says about a bad configuration: every serve flag explained, unknown
names with the closest known one, a port in use named with its address and key, and each
problem worded the same by check-config and by serve."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.config import SECTIONS, ConfigError, load_config
from sandbox_supervisor.daemon.ops.cli import SERVE_OVERRIDES, build_parser
from sandbox_supervisor.testing.authority import LoopbackAuthority

REQUIRED_ENV = {
    "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://control-plane.test",
    "SANDBOX_SUPERVISOR_AUTHORITY__JWKS_FILE": "/etc/keys/jwks.json",
}
# Long enough for a cold interpreter on a loaded machine; a healthy run takes about a second.
CLI_TIMEOUT_S = 60


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_SUPERVISOR_")}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", *args],
        capture_output=True, text=True, env=clean_env(), timeout=CLI_TIMEOUT_S,
    )


def _subcommands(parser: argparse.ArgumentParser, name: str = "sandbox-supervisor"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                yield from _subcommands(child, f"{name} {child_name}")


def test_every_flag_of_every_command_has_help() -> None:
    missing = [
        (name, action.option_strings or action.dest)
        for name, parser in _subcommands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


def test_serve_help_names_each_flags_key_and_its_default() -> None:
    serve = dict(_subcommands(build_parser()))["sandbox-supervisor serve"]
    helps = {action.dest: action.help for action in serve._actions}
    for dest, key in SERVE_OVERRIDES.items():
        assert f"(sets {key};" in helps[dest]
    assert helps["state_dir"].endswith("(sets paths.state_dir; default: /var/lib/sandbox-supervisor)")
    assert helps["listen_tcp"].endswith("(sets listen.tcp; default: 127.0.0.1:8787)")
    assert "(sets authority.issuer; required:" in helps["issuer"]


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> dict[str, str]:
    path = tmp_path / "supervisor.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env=REQUIRED_ENV if env is None else env)
    return dict(excinfo.value.problems)


def test_an_unknown_key_offers_the_closest_known_one(tmp_path: Path) -> None:
    found = problems(tmp_path, "[listen]\ntpc = []\nzzzz = 1\n[bootstrap]\nrejection_receipt_timeout = 1\n")
    where = f"(from file {tmp_path / 'supervisor.toml'})"
    assert found["listen.tpc"] == f"unknown key; did you mean listen.tcp? {where}"
    assert found["bootstrap.rejection_receipt_timeout"] == (
        f"unknown key; did you mean bootstrap.rejection_receipt_timeout_s? {where}"
    )
    assert found["listen.zzzz"] == f"unknown key {where}"  # nothing close: no guess


def test_an_unknown_section_is_called_a_section(tmp_path: Path) -> None:
    found = problems(tmp_path, "[lsten]\ntcp = []\n[nonsense]\nx = 1\n")
    where = f"(from file {tmp_path / 'supervisor.toml'})"
    assert found["lsten"] == f"unknown section; did you mean listen? {where}"
    assert found["nonsense"] == f"unknown section {where}"
    assert set(SECTIONS) >= {"listen", "logging"}


def test_an_unknown_name_from_the_environment_gets_the_same_help() -> None:
    env = {**REQUIRED_ENV, "SANDBOX_SUPERVISOR_LOGGING__LEVL": "info", "SANDBOX_SUPERVISOR_LOGGNG__LEVEL": "info"}
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, env=env)
    found = dict(excinfo.value.problems)
    assert found["logging.levl"] == (
        "unknown key; did you mean logging.level? (from environment SANDBOX_SUPERVISOR_LOGGING__LEVL)"
    )
    assert found["loggng"] == (
        "unknown section; did you mean logging? (from environment SANDBOX_SUPERVISOR_LOGGNG__LEVEL)"
    )


def test_a_section_that_is_not_a_table_says_so(tmp_path: Path) -> None:
    found = problems(tmp_path, "listen = 5\n")
    assert found["listen"] == "must be a table ([listen] in TOML)"


def _base_config(tmp_path: Path, jwks: Path) -> str:
    return (
        f'[authority]\nissuer = "https://cp.test"\njwks_file = "{jwks}"\n'
        f'[paths]\nstate_dir = "{tmp_path / "state"}"\nworkspace_root = "{tmp_path}"\n'
        f'sandbox_id_file = "{tmp_path / "sandbox-id"}"\n'
    )


def _serve_lines(stderr: str) -> list[str]:
    """What serve said about the problems: its plain lines (found before it starts) and the
    `problem` of its `supervisor.bad_configuration` log line (found while it starts)."""
    lines = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            lines.append(line)
            continue
        if event.get("event") == "supervisor.bad_configuration":
            lines.append(event["problem"])
    return lines


BAD_CONFIGS = {
    "a typo in a key": ("[listen]\ntpc = []\n", None),
    "an unknown section": ("[websockets]\nping_interval_s = 5\n", None),
    "a bad value": ("[websocket]\nping_interval_s = 100\n", None),
    "a missing JWKS file": ("", "missing"),
    "a JWKS without keys": ("", '{"keys": []}'),
    "a JWKS that is not JSON": ("", "not json"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_check_config_and_serve_word_a_problem_the_same(tmp_path: Path, case: str) -> None:
    extra, jwks_text = BAD_CONFIGS[case]
    jwks = tmp_path / "jwks.json"
    if jwks_text is None:
        LoopbackAuthority().write_jwks(jwks)
    elif jwks_text != "missing":
        jwks.write_text(jwks_text)
    (tmp_path / "sandbox-id").write_text("sb-1\n")
    config = tmp_path / "supervisor.toml"
    config.write_text(_base_config(tmp_path, jwks) + extra)

    checked = run_cli("check-config", "--config", str(config))
    served = run_cli("serve", "--config", str(config), "--listen-tcp", "127.0.0.1:0")
    assert (checked.returncode, served.returncode) == (2, 2), served.stderr
    said = checked.stderr.splitlines()
    assert said and said == _serve_lines(served.stderr)
    if jwks_text is not None:
        assert said[0].startswith(f"authority.jwks_file: ")


def _start_failed(stderr: str) -> str:
    (error,) = [
        event["error"]
        for event in map(json.loads, filter(None, stderr.splitlines()))
        if event.get("event") == "supervisor.start_failed"
    ]
    return error


def test_a_port_in_use_is_named_with_its_address_and_key(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    LoopbackAuthority().write_jwks(jwks)
    config = tmp_path / "supervisor.toml"
    config.write_text(_base_config(tmp_path, jwks))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        served = run_cli("serve", "--config", str(config), "--listen-tcp", address)
    assert served.returncode == 1
    assert _start_failed(served.stderr) == f"listen.tcp: {address} is in use: another process listens on it"


def test_a_unix_path_in_use_is_named_with_its_key(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    LoopbackAuthority().write_jwks(jwks)
    config = tmp_path / "supervisor.toml"
    config.write_text(_base_config(tmp_path, jwks))
    path = tmp_path / "taken.sock"
    with socket.socket(socket.AF_UNIX) as taken:
        taken.bind(str(path))
        taken.listen()
        served = run_cli("serve", "--config", str(config), "--listen-unix", str(path))
    assert served.returncode == 1
    assert _start_failed(served.stderr) == f"listen.unix: {path} is in use: another process listens on it"
