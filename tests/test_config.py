"""Configuration: defaults < TOML file < environment < command-line overrides; every problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.ops.cli import build_parser, build_serve_overrides
from sandbox_supervisor.daemon.config import (
    DEFAULT_BASE_ENV,
    MASK,
    ConfigError,
    load_config,
    masked_dict,
    parse_host_port,
)
from sandbox_supervisor.daemon.ops.keys import write_key_pair

REQUIRED_ENV = {
    "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://control-plane.test",
    "SANDBOX_SUPERVISOR_AUTHORITY__JWKS_FILE": "/etc/keys/jwks.json",
}

MINIMAL_TOML = """
[authority]
issuer = "https://control-plane.test"
jwks_file = "/etc/keys/jwks.json"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "supervisor.toml"
    path.write_text(text)
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(excinfo.value.problems)


def clean_env() -> dict[str, str]:
    """The test process's environment without any SANDBOX_SUPERVISOR_* leaking in."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_SUPERVISOR_")}


def test_defaults_match_operations_doc() -> None:
    config = load_config(None, env=REQUIRED_ENV)
    assert config.listen.tcp == ["127.0.0.1:8787"]
    assert config.listen.unix == []
    assert config.paths.state_dir == Path("/var/lib/sandbox-supervisor")
    assert config.paths.workspace_root == Path("/home/user")
    assert config.paths.sandbox_id_file == Path("/run/e2b/sandbox-id")
    assert config.authority.audience == "sandbox-supervisor"
    assert (config.authority.leeway_s, config.authority.max_lifetime_s) == (30, 300)
    ws = config.websocket
    routes = (ws.control_path, ws.health_path, ws.metrics_path)
    assert routes == ("/v1/control", "/healthz", "/metrics")
    assert ws.metrics_enabled is False
    assert (ws.ping_interval_s, ws.idle_timeout_s, ws.handshake_timeout_s) == (15, 60, 10)
    assert (ws.max_message_bytes, ws.max_handshakes, ws.drain_budget_s) == (131072, 64, 0.5)
    assert config.bootstrap.profiles == []
    assert config.bootstrap.rejection_receipt_timeout_s == 5
    ex = config.exec
    assert ex.shell == "/bin/bash"
    assert (ex.max_processes, ex.kill_grace_ms, ex.output_throttle_ms) == (16, 2000, 150)
    assert (ex.output_max_chunk_bytes, ex.output_buffer_bytes) == (4096, 65536)
    assert ex.spool_max_bytes == 67108864
    assert ex.base_env == DEFAULT_BASE_ENV
    assert (config.logging.level, config.logging.format) == ("info", "json")


def test_required_keys_are_named_when_missing() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, env={})
    assert problems_of(excinfo) == {
        "authority.issuer": "required",
        "authority.jwks_file": "required",
    }


def test_toml_file_values_are_used(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        MINIMAL_TOML
        + """
[listen]
tcp = ["0.0.0.0:0", "[::1]:9000"]
unix = ["/run/sv.sock"]
[websocket]
ping_interval_s = 2.5
idle_timeout_s = 10
[exec]
base_env = { PATH = "/bin", LANG = "C" }
[logging]
level = "WARNING"
format = "console"
""",
    )
    config = load_config(path, env={})
    assert config.listen.tcp == ["0.0.0.0:0", "[::1]:9000"]
    assert config.listen.unix == ["/run/sv.sock"]
    assert config.websocket.ping_interval_s == 2.5
    assert config.websocket.idle_timeout_s == 10
    assert config.exec.base_env == {"PATH": "/bin", "LANG": "C"}
    assert config.logging.level == "warning"  # case-insensitive, stored lower-case
    assert config.logging.format == "console"
    assert config.authority.jwks_file == Path("/etc/keys/jwks.json")


def test_environment_overrides_file_with_toml_values(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_TOML + "[exec]\nmax_processes = 4\n")
    env = {
        "SANDBOX_SUPERVISOR_LISTEN__TCP": '["127.0.0.1:1", "127.0.0.1:2"]',  # a TOML list
        "SANDBOX_SUPERVISOR_EXEC__MAX_PROCESSES": "8",  # a TOML int
        "SANDBOX_SUPERVISOR_EXEC__BASE_ENV": '{ PATH = "/x" }',  # an inline table
        "SANDBOX_SUPERVISOR_WEBSOCKET__METRICS_ENABLED": "true",  # a TOML bool
        "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://other.test",  # not TOML: a string
        "UNRELATED": "ignored",
    }
    config = load_config(path, env=env)
    assert config.listen.tcp == ["127.0.0.1:1", "127.0.0.1:2"]
    assert config.exec.max_processes == 8
    assert config.exec.base_env == {"PATH": "/x"}
    assert config.websocket.metrics_enabled is True
    assert config.authority.issuer == "https://other.test"


def test_environment_text_for_a_string_key_is_never_reinterpreted() -> None:
    # "123" parses as a TOML int, but issuer is text: it must stay the string "123".
    env = {**REQUIRED_ENV, "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "123"}
    assert load_config(None, env=env).authority.issuer == "123"
    # A TOML string is still a TOML value: its quotes are syntax, not content.
    env["SANDBOX_SUPERVISOR_LOGGING__FORMAT"] = '"console"'
    assert load_config(None, env=env).logging.format == "console"


def test_environment_value_that_is_several_toml_lines_is_taken_literally() -> None:
    # It parses as TOML, but as two keys: it must not smuggle in leeway_s.
    text = '"aud"\nleeway_s = 1'
    config = load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_AUTHORITY__AUDIENCE": text})
    assert config.authority.audience == text
    assert config.authority.leeway_s == 30


def test_overrides_win_over_environment_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_TOML + '[paths]\nstate_dir = "/from/file"\n')
    env = {"SANDBOX_SUPERVISOR_PATHS__STATE_DIR": "/from/env",
           "SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://env.test"}
    config = load_config(path, env=env, overrides={"paths.state_dir": "/from/cli"})
    assert config.paths.state_dir == Path("/from/cli")
    assert config.authority.issuer == "https://env.test"  # env still beats the file


def test_serve_flags_become_overrides_with_top_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_TOML + '[listen]\ntcp = ["127.0.0.1:1"]\n')
    args = build_parser().parse_args([
        "serve", "--config", str(path),
        "--listen-tcp", "127.0.0.1:0", "--listen-tcp", "[::1]:0",
        "--listen-unix", "/tmp/a.sock",
        "--state-dir", "/s", "--workspace-root", "/w", "--sandbox-id-file", "/id",
        "--jwks-file", "/k.json", "--issuer", "https://cli.test",
        "--log-format", "console", "--log-level", "debug",
    ])
    overrides = build_serve_overrides(args)
    assert overrides == {
        "listen.tcp": ["127.0.0.1:0", "[::1]:0"],
        "listen.unix": ["/tmp/a.sock"],
        "paths.state_dir": "/s",
        "paths.workspace_root": "/w",
        "paths.sandbox_id_file": "/id",
        "authority.jwks_file": "/k.json",
        "authority.issuer": "https://cli.test",
        "logging.format": "console",
        "logging.level": "debug",
    }
    env = {"SANDBOX_SUPERVISOR_AUTHORITY__ISSUER": "https://env.test"}
    config = load_config(path, env=env, overrides=overrides)
    assert config.listen.tcp == ["127.0.0.1:0", "[::1]:0"]  # replaces the file's list
    assert config.authority.issuer == "https://cli.test"
    assert config.paths.state_dir == Path("/s")


def test_serve_without_flags_overrides_nothing() -> None:
    assert build_serve_overrides(build_parser().parse_args(["serve"])) == {}


def test_unknown_key_and_section_in_file_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_TOML + "[listen]\nbogus = 1\n[nonsense]\nx = 1\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={})
    problems = problems_of(excinfo)
    assert problems["listen.bogus"].startswith("unknown key")
    assert problems["nonsense"].startswith("unknown section")
    assert str(path) in problems["listen.bogus"]


def test_unknown_key_in_environment_names_the_variable() -> None:
    env = {**REQUIRED_ENV, "SANDBOX_SUPERVISOR_LISTEN__BOGUS": "1",
           "SANDBOX_SUPERVISOR_NOPE__X": "1", "SANDBOX_SUPERVISOR_NOSEPARATOR": "1"}
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, env=env)
    problems = problems_of(excinfo)
    assert "SANDBOX_SUPERVISOR_LISTEN__BOGUS" in problems["listen.bogus"]
    assert "SANDBOX_SUPERVISOR_NOPE__X" in problems["nope"]
    assert "SANDBOX_SUPERVISOR_NOSEPARATOR" in problems


def test_every_problem_is_reported_not_just_the_first(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[listen]
tcp = ["::1:80", "localhost:65536", "nohost"]
[authority]
leeway_s = -1
[websocket]
ping_interval_s = 60
idle_timeout_s = 60
[exec]
max_processes = "16"
kill_grace_ms = true
base_env = { "bad-name" = "x" }
[logging]
format = "xml"
""",
    )
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={})
    keys = [key for key, _ in excinfo.value.problems]
    for expected in (
        "listen.tcp", "authority.issuer", "authority.jwks_file", "authority.leeway_s",
        "websocket", "exec.max_processes", "exec.kill_grace_ms", "exec.base_env",
        "logging.format",
    ):
        assert expected in keys
    problems = dict(excinfo.value.problems)
    assert "ping_interval_s must be less than idle_timeout_s" in problems["websocket"]
    for bad in ("::1:80", "localhost:65536", "nohost"):  # every bad listener, not the first
        assert bad in problems["listen.tcp"]


@pytest.mark.parametrize(
    "value, expected",
    [("127.0.0.1:8787", ("127.0.0.1", 8787)), ("[::1]:0", ("::1", 0)),
     ("localhost:65535", ("localhost", 65535))],
)
def test_host_port_accepts(value: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(value) == expected


@pytest.mark.parametrize(
    "value",
    ["::1:80", "[::1]", "host", ":80", "h:65536", "h:-1", "h:+1", "h: 1", "[zz]:1", "a b:1"],
)
def test_host_port_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(value)


def test_empty_listen_lists_load_for_socket_activation() -> None:
    # Under socket activation systemd supplies the listeners, so the file may list none; a
    # daemon that ends up with nothing to listen on is refused at start (test below).
    config = load_config(
        None,
        env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_LISTEN__TCP": "[]", "SANDBOX_SUPERVISOR_LISTEN__UNIX": "[]"},
    )
    assert config.listen.tcp == [] and config.listen.unix == []


async def test_daemon_with_no_listener_at_all_exits_2(tmp_path: Path) -> None:
    from sandbox_supervisor.testing.authority import LoopbackAuthority
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d", authority=LoopbackAuthority(), listen={"tcp": [], "unix": []})
    async with running_daemon(layout, wait_ready=False) as process:
        assert await process.wait(timeout=15) == 2
    assert "no tcp or unix listener" in process.log_text()


def test_unreadable_and_invalid_toml_files_are_problems(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(missing, env=REQUIRED_ENV)
    assert "cannot read" in problems_of(excinfo)[str(missing)]
    broken = write(tmp_path, "[listen\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(broken, env=REQUIRED_ENV)
    assert "invalid TOML" in problems_of(excinfo)[str(broken)]


def test_masked_dict_masks_secret_names_but_not_jwks_file() -> None:
    base_env = '{ PATH = "/bin", GITHUB_TOKEN = "s3cret" }'
    env = {**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__BASE_ENV": base_env}
    data = masked_dict(load_config(None, env=env))
    assert data["exec"]["base_env"] == {"PATH": "/bin", "GITHUB_TOKEN": MASK}
    assert data["authority"]["jwks_file"] == "/etc/keys/jwks.json"
    json.dumps(data)  # JSON-ready


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", *args],
        capture_output=True, text=True, env=env if env is not None else clean_env(), timeout=60,
    )


def test_check_config_prints_effective_config_and_exits_0(tmp_path: Path) -> None:
    _, jwks = write_key_pair(tmp_path / "keys", "k1")
    path = write(tmp_path, f'[authority]\nissuer = "https://cp.test"\njwks_file = "{jwks}"\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["authority"]["issuer"] == "https://cp.test"
    assert printed["listen"]["tcp"] == ["127.0.0.1:8787"]


def test_check_config_lists_every_problem_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, "[listen]\nbogus = 1\n[exec]\nmax_processes = 0\n")
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    for key in ("listen.bogus", "exec.max_processes", "authority.issuer", "authority.jwks_file"):
        assert any(line.startswith(f"{key}: ") for line in lines), result.stderr
    assert result.stdout == ""


def test_check_config_refuses_a_jwks_file_that_cannot_be_read(tmp_path: Path) -> None:
    path = write(tmp_path, f'[authority]\nissuer = "x"\njwks_file = "{tmp_path / "none.json"}"\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith("authority.jwks_file: ")


def test_bad_arguments_exit_2() -> None:
    assert run_cli("check-config", "--no-such-flag").returncode == 2
    assert run_cli("no-such-command").returncode == 2
    assert run_cli().returncode == 2


def test_the_images_build_sha_variable_is_not_a_config_override() -> None:
    """operations.md's Dockerfile sets the build commit in the image's environment; serve and
    check-config inherit it, so it must not fall under the override prefix, where an
    unknown name is an error."""
    from sandbox_supervisor.daemon.config import ENV_PREFIX
    from sandbox_supervisor.daemon.ops.onboarding import BUILD_SHA_ENV

    assert not BUILD_SHA_ENV.startswith(ENV_PREFIX)
    config = load_config(None, env={**REQUIRED_ENV, BUILD_SHA_ENV: "a" * 40})
    assert config.authority.issuer
    with pytest.raises(ConfigError):  # a stray name under the prefix is still caught
        load_config(None, env={**REQUIRED_ENV, ENV_PREFIX + "BUILD_SHA": "a" * 40})


def test_every_configurable_log_level_filters_as_named() -> None:
    import io
    from typing import get_args

    import structlog

    from sandbox_supervisor.daemon.config import LogLevel
    from sandbox_supervisor.daemon.ops.logs import LEVELS, configure_logging

    assert set(LEVELS) == set(get_args(LogLevel))
    stream = io.StringIO()
    configure_logging("critical", stream=stream)
    structlog.get_logger("t").error("not.shown")
    structlog.get_logger("t").critical("shown")
    assert "shown" in stream.getvalue() and "not.shown" not in stream.getvalue()
    configure_logging("info")


def test_bad_bytes_and_huge_numbers_in_the_config_are_reported_not_raised(tmp_path) -> None:
    not_utf8 = tmp_path / "c.toml"
    not_utf8.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError) as caught:
        load_config(not_utf8, env=REQUIRED_ENV)
    assert any("invalid TOML" in message for _, message in caught.value.problems)
    huge = tmp_path / "h.toml"
    huge.write_text("[exec]\nmax_processes = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError):
        load_config(huge, env=REQUIRED_ENV)
    with pytest.raises(ConfigError):
        load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__MAX_PROCESSES": "9" * 5000})
    with pytest.raises(ConfigError) as caught:
        load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_PATHS__STATE_DIR": '"/tmp/a\\u0000b"'})
    assert any("NUL" in message for _, message in caught.value.problems)


def test_idempotency_retention_defaults_and_values(tmp_path: Path) -> None:
    """[idempotency] (docs/operations.md): 24 h and 256 MiB unless set; the daemon's store
    gets exactly what was configured."""
    config = load_config(None, env=REQUIRED_ENV)
    assert (config.idempotency.max_age_s, config.idempotency.max_result_bytes) == (86400, 268435456)
    path = write(tmp_path, MINIMAL_TOML + "[idempotency]\nmax_age_s = 3600\nmax_result_bytes = 1048576\n")
    retention = load_config(path, env={}).idempotency.retention()
    assert (retention.max_age_s, retention.max_result_bytes) == (3600, 1048576)


def test_bad_idempotency_retention_values_exit_2_naming_each_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL_TOML + '[idempotency]\nmax_age_s = 0\nmax_result_bytes = "1 GiB"\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    for key in ("idempotency.max_age_s", "idempotency.max_result_bytes"):
        assert any(line.startswith(f"{key}: ") for line in lines), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_IDEMPOTENCY__MAX_RESULT_BYTES": "-1"})
    assert "greater than 0" in problems_of(excinfo)["idempotency.max_result_bytes"]


def test_check_config_prints_the_command_user_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    """`[exec] user/group/supplementary_groups` (docs/operations.md, "Privilege separation"):
    printed as configured; a name the machine does not know is exit 2 under its own key."""
    _, jwks = write_key_pair(tmp_path / "keys", "k1")
    base = f'[authority]\nissuer = "https://cp.test"\njwks_file = "{jwks}"\n'
    path = write(tmp_path, base + '[exec]\nuser = "nobody"\ngroup = "nogroup"\nsupplementary_groups = [0]\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)["exec"]
    assert (printed["user"], printed["group"], printed["supplementary_groups"]) == ("nobody", "nogroup", [0])
    unset = json.loads(run_cli("check-config", "--config", str(write(tmp_path, base))).stdout)["exec"]
    assert (unset["user"], unset["group"], unset["supplementary_groups"]) == (None, None, [])
    path = write(tmp_path, base + '[exec]\nuser = "sbx-no-such-user"\ngroup = "sbx-no-such-group"\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert any(line.startswith("exec.user: unknown user 'sbx-no-such-user'") for line in lines), result.stderr
    assert any(line.startswith("exec.group: unknown group 'sbx-no-such-group'") for line in lines), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_check_config_prints_login_shell_and_refuses_a_value_that_is_not_a_boolean(tmp_path: Path) -> None:
    """`[exec] login_shell` (docs/operations.md, "The command environment"): false unless set,
    a TOML boolean (no "yes", no 1), from the file or the environment."""
    _, jwks = write_key_pair(tmp_path / "keys", "k1")
    base = f'[authority]\nissuer = "https://cp.test"\njwks_file = "{jwks}"\n'
    unset = run_cli("check-config", "--config", str(write(tmp_path, base)))
    assert json.loads(unset.stdout)["exec"]["login_shell"] is False, unset.stderr
    on = run_cli("check-config", "--config", str(write(tmp_path, base + "[exec]\nlogin_shell = true\n")))
    assert json.loads(on.stdout)["exec"]["login_shell"] is True, on.stderr
    for bad in ('"yes"', "1"):
        result = run_cli("check-config", "--config", str(write(tmp_path, base + f"[exec]\nlogin_shell = {bad}\n")))
        assert result.returncode == 2 and result.stderr.startswith("exec.login_shell: "), result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__LOGIN_SHELL": "true"}).exec.login_shell
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, env={**REQUIRED_ENV, "SANDBOX_SUPERVISOR_EXEC__LOGIN_SHELL": "on"})
    assert "exec.login_shell" in problems_of(excinfo)


def test_check_config_validates_the_cgroup_keys(tmp_path: Path) -> None:
    """[exec] cgroup, cgroup_root, memory_max, pids_max (docs/operations.md, "Process
    isolation"): each bad value under its own key, and a limit with cgroup = "off" refused,
    since nothing would enforce it."""
    path = write(tmp_path, '[exec]\ncgroup = "v2"\ncgroup_root = "relative/dir"\nmemory_max = 1000\npids_max = 0\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    for key in ("exec.cgroup", "exec.cgroup_root", "exec.memory_max", "exec.pids_max"):
        assert any(line.startswith(f"{key}: ") for line in lines), result.stderr
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, '[exec]\ncgroup = "off"\nmemory_max = 1048576\n'), env=REQUIRED_ENV)
    assert "memory_max needs cgroup" in " ".join(problems_of(excinfo).values())
    config = load_config(
        write(tmp_path, '[exec]\ncgroup_root = "/sys/fs/cgroup/x"\nmemory_max = 1048576\npids_max = 64\n'), env=REQUIRED_ENV
    )
    assert (config.exec.cgroup, str(config.exec.cgroup_root), config.exec.memory_max, config.exec.pids_max) == (
        "auto", "/sys/fs/cgroup/x", 1048576, 64
    )
