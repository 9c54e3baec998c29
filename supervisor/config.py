"""Typed configuration: defaults < TOML file < environment < command-line overrides.

Every default lives in the models below (README.md, "Configuration"). `load_config`
merges the sources into one raw dict and validates it once, so every problem is reported
together, each with its dotted key.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from sandbox_supervisor.protocol import bootstrap, frames
from sandbox_supervisor.protocol.addresses import parse_host_port
from sandbox_supervisor.daemon.edge.server import default_unix_allowed_uids
from sandbox_supervisor.daemon.runtime.command_host import MAX_IDLE_SHELLS
from sandbox_supervisor.daemon.runtime.identity import (
    CommandIdentity,
    check_group,
    check_user,
    resolve_identity,
)
from sandbox_supervisor.daemon.state.store import (
    DEFAULT_CALL_MAX_AGE_S,
    DEFAULT_CALL_MAX_RESULT_BYTES,
    DEFAULT_MAX_UNACKED_BYTES,
    CallRetention,
)

__all__ = ["parse_host_port"]  # re-exported: listen addresses are validated with it

ENV_PREFIX = "SANDBOX_SUPERVISOR_"
# Separates section from key in an environment variable name (SECTION__KEY).
ENV_SECTION_SEPARATOR = "__"

MASK = "***"
# Key names containing one of these are masked by `masked_dict` (none exist today; the rule is
# here so a future secret cannot leak through check-config by accident).
SECRET_KEY_MARKERS = ("secret", "token", "key", "password")
# jwks_file names a public key file, not a secret: never mask it.
NOT_SECRET_KEYS = frozenset({"jwks_file"})

ENV_NAME_PATTERN = re.compile(r"^[A-Z_][A-Z0-9_]*$")
PROFILE_PATTERN = re.compile(bootstrap.PROFILE_PATTERN)  # the profiles a bootstrap can name

# The directories of the PATH a command gets when no layer of its environment sets one
# (docs/protocol.md §7.4.1): the ones Debian's /etc/profile gives root, so tools installed in
# any of them are found whoever runs them. The command user's ~/.local/bin comes first
# (shell.default_path). Not part of DEFAULT_BASE_ENV: that home is known only once the user
# is, and a base_env without PATH still gets this default.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

DEFAULT_BASE_ENV = {
    "LANG": "C.UTF-8",
    "HOME": "/home/user",
}

# Sections are strict (no "15" → 15, no true → 1) except paths, which must convert from the
# TOML/env strings that carry them.
def _no_nul(path: Path) -> Path:
    # The OS refuses such a path at its first use, far from the setting that caused it.
    if "\x00" in str(path):
        raise ValueError("a path must not contain a NUL byte")
    return path


LaxPath = Annotated[Path, Field(strict=False), AfterValidator(_no_nul)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]
# [exec] memory_max: below this a shell cannot even start, so every command would be
# OOM-killed at once; a smaller value is a typo, not a policy.
MIN_MEMORY_MAX_BYTES = 1024 * 1024

# listen.unix_allowed_uids: at most this many entries (a list of every account on the machine
# is a misconfiguration, not a policy), each a real uid: (uid_t)-1 is the "no uid" marker.
MAX_UNIX_ALLOWED_UIDS = 64
MAX_UID = 2**32 - 2



class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ListenConfig(_Section):
    tcp: list[str] = ["127.0.0.1:8787"]
    unix: list[str] = []
    # Who may connect over the unix sockets, checked on the peer's credentials (SO_PEERCRED)
    # at accept, before a byte is read (docs/protocol.md §1.1). The list is the whole set:
    # leaving 0 out locks root's own tools out too.
    unix_allowed_uids: list[int] = Field(
        default_factory=lambda: sorted(default_unix_allowed_uids()), max_length=MAX_UNIX_ALLOWED_UIDS
    )

    @field_validator("tcp")
    @classmethod
    def _check_tcp(cls, value: list[str]) -> list[str]:
        # Name every bad entry at once, not only the first.
        errors = []
        for entry in value:
            try:
                parse_host_port(entry)
            except ValueError as exc:
                errors.append(str(exc))
        if errors:
            raise ValueError("; ".join(errors))
        return value

    @field_validator("unix")
    @classmethod
    def _check_unix(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not entry or "\x00" in entry:
                raise ValueError("a unix socket path must be non-empty and contain no NUL")
        return value

    @field_validator("unix_allowed_uids")
    @classmethod
    def _check_uids(cls, value: list[int]) -> list[int]:
        # Empty would refuse every peer, root's health checks included: a listener nobody may
        # use is a mistake, not a policy (leave the key out for the default).
        if not value:
            raise ValueError("must name at least one uid (leave it unset for the daemon's uid and root)")
        bad = [uid for uid in value if not 0 <= uid <= MAX_UID]
        if bad:
            raise ValueError(f"uids must be between 0 and {MAX_UID}: {bad}")
        return sorted(set(value))


class PathsConfig(_Section):
    state_dir: LaxPath = Path("/var/lib/sandbox-supervisor")
    workspace_root: LaxPath = Path("/home/user")
    sandbox_id_file: LaxPath = Path("/run/e2b/sandbox-id")


class AuthorityConfig(_Section):
    # Required: a daemon must never fall back to trusting some default issuer or key file.
    issuer: str = Field(min_length=1)
    audience: str = Field(default="sandbox-supervisor", min_length=1)
    jwks_file: LaxPath
    leeway_s: int = Field(default=30, ge=0)
    max_lifetime_s: PositiveInt = 300
    # Every admitted assertion holds session:control, as before that scope existed: only for
    # the rollout of a control plane that does not grant it yet (docs/operations.md).
    legacy_session_control: bool = False


class WebSocketConfig(_Section):
    control_path: str = "/v1/control"
    health_path: str = "/healthz"
    metrics_path: str = "/metrics"
    metrics_enabled: bool = False
    # --- readiness and the metrics listener (docs/operations.md, "Health and readiness",
    # "Metrics") ---
    ready_path: str = "/readyz"
    # Serve metrics on this loopback HOST:PORT alone (and no longer on the control
    # listeners); unset: metrics share the control listeners.
    metrics_listen: str | None = None
    # --- end of readiness and the metrics listener ---
    ping_interval_s: PositiveSeconds = 15.0
    idle_timeout_s: PositiveSeconds = 60.0
    max_message_bytes: PositiveInt = frames.DEFAULT_MAX_MESSAGE_BYTES
    handshake_timeout_s: PositiveSeconds = 10.0
    # Handshake slots of the TCP listeners; the unix listeners have a pool of their own, so a
    # TCP flood cannot lock out a control plane that connects over the unix socket.
    max_handshakes: PositiveInt = 64
    max_unix_handshakes: PositiveInt = 64
    # Pending handshakes one TCP source address may hold at once.
    max_handshakes_per_peer: PositiveInt = 8
    drain_budget_s: PositiveSeconds = 0.5
    # A frame the peer has not taken for this long (its socket buffers full: it stopped
    # reading) closes the socket: a peer that sends but never reads must not hold a socket,
    # its sender and a batch of frames for ever. Its events stay journaled for a reconnect.
    write_timeout_s: PositiveSeconds = 60.0

    @field_validator("control_path", "health_path", "metrics_path", "ready_path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.startswith("/") or any(c.isspace() for c in value):
            raise ValueError("a route must start with '/' and contain no whitespace")
        return value

    @model_validator(mode="after")
    def _check_relations(self) -> WebSocketConfig:
        # A ping interval at or above the idle timeout would close healthy idle connections.
        if self.ping_interval_s >= self.idle_timeout_s:
            raise ValueError("ping_interval_s must be less than idle_timeout_s")
        routes = [self.control_path, self.health_path, self.metrics_path, self.ready_path]
        if len(set(routes)) != len(routes):
            raise ValueError("control_path, health_path, metrics_path and ready_path must differ")
        if self.metrics_listen is not None and not self.metrics_enabled:
            raise ValueError("metrics_listen needs metrics_enabled = true")
        return self

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str | None) -> str | None:
        if value is not None:
            check_loopback_address(value)
        return value


def check_loopback_address(value: str) -> None:
    """A HOST:PORT whose host is a loopback IP literal (127.0.0.0/8, ::1); ValueError else.
    Metrics are served without authentication, so their own listener is never reachable
    from outside the machine; a host name is refused too (it could resolve elsewhere)."""
    host, _port = parse_host_port(value)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"{value!r} is not a loopback address: metrics are served without authentication, "
            "so their own listener must be 127.0.0.1:PORT or [::1]:PORT"
        )


class BootstrapConfig(_Section):
    profiles: list[str] = []  # empty = any profile is allowed
    rejection_receipt_timeout_s: PositiveSeconds = 5.0

    @field_validator("profiles")
    @classmethod
    def _check_profiles(cls, value: list[str]) -> list[str]:
        for name in value:
            if not PROFILE_PATTERN.match(name):
                raise ValueError(f"profile {name!r} must be 1-64 chars of [a-z][a-z0-9.-]*")
        return value


class ExecConfig(_Section):
    shell: str = "/bin/bash"
    max_processes: PositiveInt = 16
    kill_grace_ms: PositiveInt = 2000
    output_throttle_ms: PositiveInt = 150
    # At least one whole UTF-8 character (4 bytes): events never split a character.
    output_max_chunk_bytes: int = Field(default=4096, ge=4)
    output_buffer_bytes: PositiveInt = 65536
    spool_max_bytes: PositiveInt = 64 * 1024 * 1024
    # All spools together: past this, the oldest finished commands' spools are deleted
    # (docs/protocol.md §7.4.6; docs/deltas.md item 37).
    spool_total_max_bytes: PositiveInt = 1024 * 1024 * 1024
    base_env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_BASE_ENV))
    # Run commands as `<shell> -l -c <command>`, so the command user's profile files are read
    # (E2B runs `bash -l -c`). Never for a call whose assertion has allowed_commands: those
    # files are the agent's to write, and the guard never judged what is in them (§7.4.1).
    login_shell: bool = False
    # Pre-started shells (docs/operations.md, "Pre-started shells"): how many idle `bash -c`
    # shells the command host keeps ready for the next execute_shell_command; 0: none, every
    # command is spawned when it is called.
    idle_shells: Annotated[int, Field(ge=0, le=MAX_IDLE_SHELLS)] = 1
    # start_process (docs/protocol.md §7.7): the longest timeout a process may ask for, and
    # the one it gets when it asks for none. Unset: no limit (a dev server runs for hours).
    process_max_timeout_ms: PositiveInt | None = None
    # Privilege separation (docs/operations.md): commands run as this user (a name or a uid),
    # with this group (default: the user's primary group) and exactly these supplementary
    # groups. Unset: commands run as the daemon's own user, as before.
    user: str | int | None = None
    group: str | int | None = None
    supplementary_groups: list[str | int] = []
    # Process isolation (docs/operations.md, "Process isolation"): one cgroup per command
    # where the machine offers one ("auto"), or process groups alone ("off"). cgroup_root: a
    # cgroup v2 directory to manage (default: the daemon's own cgroup when systemd delegated
    # it). memory_max (bytes) and pids_max: each command's limits; unset: none.
    cgroup: Literal["auto", "off"] = "auto"
    cgroup_root: LaxPath | None = None
    memory_max: Annotated[int, Field(ge=MIN_MEMORY_MAX_BYTES)] | None = None
    pids_max: PositiveInt | None = None

    @field_validator("cgroup_root")
    @classmethod
    def _check_cgroup_root(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("cgroup_root must be an absolute path")
        return value

    @field_validator("shell")
    @classmethod
    def _check_shell(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("shell must be an absolute path")
        return value

    # Each name is looked up on its own first, so an unknown one is reported under its own key.
    @field_validator("user")
    @classmethod
    def _check_user(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            check_user(value)
        return value

    @field_validator("group")
    @classmethod
    def _check_group(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            check_group(value)
        return value

    @field_validator("supplementary_groups")
    @classmethod
    def _check_groups(cls, value: list[str | int]) -> list[str | int]:
        for group in value:
            check_group(group)
        return value

    @field_validator("base_env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not ENV_NAME_PATTERN.match(name):
                raise ValueError(f"environment name {name!r} must match {ENV_NAME_PATTERN.pattern}")
            if "\x00" in text:
                raise ValueError(f"environment value of {name} contains NUL")
        return value

    @model_validator(mode="after")
    def _check_buffer(self) -> ExecConfig:
        # The live buffer must hold at least one full chunk, or no event could ever be full size.
        if self.output_buffer_bytes < self.output_max_chunk_bytes:
            raise ValueError("output_buffer_bytes must be at least output_max_chunk_bytes")
        if self.cgroup == "off":
            # Each needs a cgroup: accepted and then ignored, it would promise a limit that
            # nothing enforces.
            for name in ("cgroup_root", "memory_max", "pids_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f'{name} needs cgroup = "auto"')
        # Resolved once here, so an unknown name is a configuration error (exit 2) at start.
        self.command_identity()
        return self

    def command_identity(self) -> CommandIdentity | None:
        """The `[exec] user` commands run as, resolved; None when unset."""
        if self.user is None:
            if self.group is not None or self.supplementary_groups:
                raise ValueError("group and supplementary_groups need user to be set")
            return None
        return resolve_identity(self.user, self.group, self.supplementary_groups)


class IdempotencyConfig(_Section):
    """Retention of completed idempotency records (docs/protocol.md §8): a key is remembered
    for `max_age_s` after its call completed, and while the stored results of all completed
    calls fit in `max_result_bytes` (the oldest are forgotten first). A forgotten key runs
    again. Pending records are never forgotten."""

    max_age_s: PositiveSeconds = DEFAULT_CALL_MAX_AGE_S
    max_result_bytes: PositiveInt = DEFAULT_CALL_MAX_RESULT_BYTES

    def retention(self) -> CallRetention:
        return CallRetention(max_age_s=self.max_age_s, max_result_bytes=self.max_result_bytes)


class JournalConfig(_Section):
    """The journal's bound on disk (docs/operations.md, "Faults and what the daemon does"):
    past `max_unacked_bytes` of events the client has not acked, new tool calls are refused
    (`journal_full`) until it acks; no unacked event is ever dropped."""

    max_unacked_bytes: PositiveInt = DEFAULT_MAX_UNACKED_BYTES


class FilesConfig(_Section):
    # read_file and apply_file_patch refuse a larger file (file_too_large), checked on the
    # opened file before a byte is read: hashing or loading it would take a worker thread
    # (or, for a patch, memory) for as long as the file is big.
    max_file_bytes: PositiveInt = 256 * 1024 * 1024


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class LoggingConfig(_Section):
    level: LogLevel = "info"
    format: Literal["json", "console"] = "json"

    @field_validator("level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        # "INFO" and "info" mean the same to an operator.
        return value.lower() if isinstance(value, str) else value


class SupervisorConfig(_Section):
    listen: ListenConfig = ListenConfig()
    paths: PathsConfig = PathsConfig()
    authority: AuthorityConfig
    websocket: WebSocketConfig = WebSocketConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    exec: ExecConfig = ExecConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    journal: JournalConfig = JournalConfig()
    files: FilesConfig = FilesConfig()
    logging: LoggingConfig = LoggingConfig()


def _section_models() -> dict[str, type[BaseModel]]:
    sections: dict[str, type[BaseModel]] = {}
    for name, field in SupervisorConfig.model_fields.items():
        model = field.annotation
        # Every field of SupervisorConfig is a section model; a plain field added there by
        # mistake fails here, at import, instead of confusing the env-value parsing below.
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"SupervisorConfig.{name} is not a section model")
        sections[name] = model
    return sections


SECTIONS = _section_models()


# The keys a start-up problem outside the models is reported under (app.py, edge/server.py).
JWKS_FILE_KEY = "authority.jwks_file"

# How close a name must be to a known one to be offered as "did you mean" (difflib's ratio:
# 0.6 is its default; "tpc" → "tcp" is 0.67, "lsten" → "listen" 0.91).
SUGGESTION_CUTOFF = 0.6


def config_problem(key: str, message: str) -> str:
    """One configuration problem as the operator reads it, `key: message`: check-config, serve
    before it starts and the daemon's start-up refusals (`supervisor.bad_configuration`,
    `supervisor.start_failed`) all word a problem with this, so each reads the same wherever
    it is found."""
    return f"{key}: {message}"


class ConfigError(Exception):
    """Every problem found, each as (dotted key, message)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(config_problem(key, message) for key, message in problems))

    def lines(self) -> list[str]:
        return [config_problem(key, message) for key, message in self.problems]


def load_config(
    path: Path | None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, object] = {},
) -> SupervisorConfig:
    """Merge defaults < file < environment < overrides and validate; raise ConfigError."""
    problems: list[tuple[str, str]] = []
    # Where each (section, key) was last set from, so a problem names its source.
    origins: dict[tuple[str, str], str] = {}
    raw: dict[str, object] = {}

    if path is not None:
        raw = _read_toml(path, problems)
        for section, table in raw.items():
            if isinstance(table, dict):
                for key in table:
                    origins[(section, key)] = f"file {path}"

    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name[len(ENV_PREFIX):].partition(ENV_SECTION_SEPARATOR)
        if not sep or not section or not key:
            problems.append(
                (name, f"expected {ENV_PREFIX}<SECTION>{ENV_SECTION_SEPARATOR}<KEY>")
            )
            continue
        section, key = section.lower(), key.lower()
        _set(raw, section, key, _env_value(section, key, env[name]))
        origins[(section, key)] = f"environment {name}"

    for dotted, value in overrides.items():
        section, sep, key = dotted.partition(".")
        if not sep or not section or not key or "." in key:
            problems.append((dotted, "an override key must be SECTION.KEY"))
            continue
        _set(raw, section, key, value)
        origins[(section, key)] = "command line"

    # Absent sections validate as empty tables, so a missing required key is named exactly
    # (authority.issuer) instead of as a missing section.
    for section in SECTIONS:
        raw.setdefault(section, {})

    try:
        config = SupervisorConfig.model_validate(raw)
    except ValidationError as exc:
        problems.extend(_describe(error, origins) for error in exc.errors())
        config = None
    if problems:
        raise ConfigError(problems)
    assert config is not None
    return config


def _read_toml(path: Path, problems: list[tuple[str, str]]) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        problems.append((str(path), f"cannot read the configuration file: {exc.strerror}"))
    except ValueError as exc:
        # TOMLDecodeError, a file that is not UTF-8, an integer past Python's digit limit.
        problems.append((str(path), f"invalid TOML: {exc}"))
    return {}


def _set(raw: dict[str, object], section: str, key: str, value: object) -> None:
    table = raw.setdefault(section, {})
    # A section that is not a table is already an error pydantic will report; do not hide it.
    if isinstance(table, dict):
        table[key] = value


def _field_wants_string(section: str, key: str) -> bool:
    """True when the target field takes text, so an env value is never reinterpreted as TOML."""
    model = SECTIONS.get(section)
    if model is None or key not in model.model_fields:
        return False
    annotation = model.model_fields[key].annotation
    if annotation in (str, Path):
        return True
    args = getattr(annotation, "__args__", ())
    return bool(args) and all(isinstance(a, str) for a in args)  # Literal["json", ...]


def _env_value(section: str, key: str, text: str) -> object:
    """An env value is a TOML value when it parses as exactly one (lists, ints, inline
    tables, quoted strings), otherwise the raw string, so `https://x` needs no quoting.
    For a text key, only a TOML string counts: issuer `123` stays the string "123"."""
    try:
        parsed = tomllib.loads(f"value = {text}")
    except ValueError:  # not TOML (or an integer past Python's digit limit): the raw text
        return text
    # Text like "1\nother = 2" parses, but as more than one value: take it literally.
    if list(parsed) != ["value"]:
        return text
    value = parsed["value"]
    if _field_wants_string(section, key) and not isinstance(value, str):
        return text
    return value


def _describe(error: ErrorDetails, origins: Mapping[tuple[str, str], str]) -> tuple[str, str]:
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc) if loc else "(config)"
    if error["type"] == "extra_forbidden":
        message = _unknown_name(loc)
    elif error["type"] == "model_type" and len(loc) == 1:
        # `listen = 5`: pydantic would say "a valid dictionary or instance of ListenConfig".
        message = f"must be a table ([{loc[0]}] in TOML)"
    elif error["type"] == "missing":
        message = "required"
    else:
        message = error["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
    if len(loc) >= 2:
        where = (loc[0], loc[1])
        sources = [origins[where]] if where in origins else []
    else:
        # An unknown section: name every source that set a key in it.
        sources = sorted({o for (section, _), o in origins.items() if loc and section == loc[0]})
    if sources:
        message = f"{message} (from {', '.join(sources)})"
    return key, message


def _unknown_name(loc: tuple[str, ...]) -> str:
    """An unknown section is called a section, an unknown key a key; either with the closest
    known name when one is near enough (a typo), spelled as the operator would write it."""
    if len(loc) == 1:
        what, known, prefix = "section", list(SECTIONS), ""
    else:
        model = SECTIONS.get(loc[0])
        known = list(model.model_fields) if model is not None and len(loc) == 2 else []
        what, prefix = "key", f"{loc[0]}."
    close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=SUGGESTION_CUTOFF)
    return f"unknown {what}; did you mean {prefix}{close[0]}?" if close else f"unknown {what}"


def masked_dict(config: SupervisorConfig) -> dict[str, JsonValue]:
    """The effective configuration as JSON-ready data, secrets masked.

    Nothing in the configuration is secret today (the JWKS is a public key file); any key whose
    name contains one of SECRET_KEY_MARKERS is masked so a future secret is safe by default.
    """
    return _mask_table(config.model_dump(mode="json"))


def _mask_table(table: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
    return {k: MASK if _is_secret_name(k) else _mask(v) for k, v in table.items()}


def _mask(value: JsonValue) -> JsonValue:
    if isinstance(value, dict):
        return _mask_table(value)
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered not in NOT_SECRET_KEYS and any(m in lowered for m in SECRET_KEY_MARKERS)
