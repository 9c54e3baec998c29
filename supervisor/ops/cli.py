"""Command line: serve, check-config, reset-state, keys, onboard-template, install-units,
--version (docs/operations.md).

The daemon (`app`) is imported inside its handler, so the light commands (check-config, keys)
start fast and work without the daemon's dependencies loaded. The demo is the kit's
(`sandbox-supervisor-demo`): the daemon imports nothing from `sandbox_supervisor.testing`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandbox_supervisor.daemon.exits import EXIT_CONFIG, EXIT_OK
from sandbox_supervisor.daemon.version import UNKNOWN_VERSION, installed_version
from sandbox_supervisor.daemon.config import (
    JWKS_FILE_KEY,
    SECTIONS,
    ConfigError,
    SupervisorConfig,
    config_problem,
    load_config,
    masked_dict,
)

PROG = "sandbox-supervisor"
# What --version says when the code runs without installed metadata (the same as /healthz).

# serve flag (argparse dest) → dotted configuration key it overrides.
SERVE_OVERRIDES = {
    "listen_tcp": "listen.tcp",
    "listen_unix": "listen.unix",
    "state_dir": "paths.state_dir",
    "workspace_root": "paths.workspace_root",
    "sandbox_id_file": "paths.sandbox_id_file",
    "jwks_file": "authority.jwks_file",
    "issuer": "authority.issuer",
    "log_format": "logging.format",
    "log_level": "logging.level",
}


def build_serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted-key overrides from the serve flags that were given. A repeated listen flag
    replaces the file's whole list (it does not append to it)."""
    overrides: dict[str, Any] = {}
    for dest, key in SERVE_OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="In-sandbox supervisor daemon.")
    parser.add_argument("--version", action="version", version=f"{PROG} {installed_version() or UNKNOWN_VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon. Each flag sets one configuration key over the file and the "
        "SANDBOX_SUPERVISOR_* environment (README.md, \"Configuration\").",
    )
    _add_config_flag(serve)
    serve.add_argument("--listen-tcp", action="append", metavar="HOST:PORT",
                       help=_override_help("a TCP listener; repeatable, replaces the whole list", "listen_tcp"))
    serve.add_argument("--listen-unix", action="append", metavar="PATH",
                       help=_override_help("a unix socket listener; repeatable, replaces the whole list",
                                           "listen_unix"))
    serve.add_argument("--state-dir", metavar="DIR",
                       help=_override_help("where the state database, journal and spools live", "state_dir"))
    serve.add_argument("--workspace-root", metavar="DIR",
                       help=_override_help("the directory a bootstrap's agent.cwd must lie in", "workspace_root"))
    serve.add_argument("--sandbox-id-file", metavar="FILE",
                       help=_override_help("the file holding this sandbox's id", "sandbox_id_file"))
    serve.add_argument("--jwks-file", metavar="FILE",
                       help=_override_help("the public keys (JWKS) assertions are checked with", "jwks_file"))
    serve.add_argument("--issuer", metavar="S", help=_override_help("the assertions' required iss", "issuer"))
    serve.add_argument("--log-format", choices=("json", "console"),
                       help=_override_help("json lines, or console lines for a person", "log_format"))
    serve.add_argument("--log-level", metavar="L",
                       help=_override_help("debug, info, warning, error or critical", "log_level"))
    serve.set_defaults(handler=_cmd_serve)

    check = commands.add_parser("check-config", help="validate and print the configuration")
    _add_config_flag(check)
    check.set_defaults(handler=_cmd_check_config)

    reset = commands.add_parser(
        "reset-state",
        help="move a refused state aside so the next start begins afresh",
        description="Move the state database (with its -wal and -shm), instance.json, the "
        "journal's high-water mark and the spool into STATE_DIR/damaged-<UTC time>/ (nothing is "
        "deleted); the next start initialises a new, unbound state. Run it with the daemon "
        "stopped, after it refused to start (supervisor.state_refused, exit 2).",
    )
    _add_config_flag(reset)
    reset.add_argument("--state-dir", metavar="DIR", help="the state directory (default: paths.state_dir)")
    reset.set_defaults(handler=_cmd_reset_state)


    keys = commands.add_parser("keys", help="development keys and assertions")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    generate = key_commands.add_parser("generate", help="write signing-key.jwk and jwks.json")
    generate.add_argument("--out-dir", required=True, type=Path, metavar="DIR",
                          help="the directory to write both files into (created when missing)")
    generate.add_argument("--kid", help="key id (default: the key's RFC 7638 thumbprint)")
    generate.add_argument("--force", action="store_true", help="replace existing files")
    generate.set_defaults(handler=_cmd_keys_generate)
    mint = key_commands.add_parser("mint", help="print a signed assertion")
    mint.add_argument("--key", required=True, type=Path, metavar="FILE",
                      help="private signing JWK (signing-key.jwk)")
    mint.add_argument("--claims", required=True, metavar="JSON",
                      help="claims object; iat, exp and jti are filled when absent")
    mint.add_argument("--lifetime", type=int, metavar="S", help="seconds from iat to exp")
    mint.set_defaults(handler=_cmd_keys_mint)

    onboard = commands.add_parser(
        "onboard-template",
        help="print (and with --store upsert) the template onboarding record",
        description="Compute the hashes of the installed supervisor, take the rest from the "
        "flags, validate, print the record as JSON; every problem is printed (exit 2).",
    )
    from sandbox_supervisor.daemon.ops.onboarding import add_arguments as add_onboarding_arguments

    add_onboarding_arguments(onboard)
    onboard.set_defaults(handler=_cmd_onboard_template)

    units = commands.add_parser(
        "install-units",
        help="write the systemd units and the example configuration",
        description="Write the units shipped in the package into ROOT/etc/systemd/system/ "
        "(replacing them) and the example configuration to "
        "ROOT/etc/sandbox-supervisor/supervisor.toml (kept when it exists, unless --force).",
    )
    units.add_argument("--root", type=Path, default=Path("/"), metavar="DIR",
                       help="install under this directory, e.g. an image's root (default: /)")
    units.add_argument("--force", action="store_true", help="replace an existing configuration")
    units.set_defaults(handler=_cmd_install_units)
    return parser


def _override_help(text: str, dest: str) -> str:
    """A serve flag's help: what it sets, the key it overrides and that key's default, read
    from the configuration models (so the help cannot drift from them)."""
    key = SERVE_OVERRIDES[dest]
    section, name = key.split(".")
    field = SECTIONS[section].model_fields[name]
    if field.is_required():
        default = "required: here, in the file or in the environment"
    else:
        value = field.get_default(call_default_factory=True)
        shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        default = f"default: {shown or 'none'}"
    # argparse expands %-formats in help text: a literal % in a default must be doubled.
    return f"{text} (sets {key}; {default})".replace("%", "%%")


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    # Optional: without it, defaults and SANDBOX_SUPERVISOR_* variables must suffice.
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 on --help
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


def _error(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def _load(args: argparse.Namespace, overrides: dict[str, Any]) -> SupervisorConfig | None:
    """The configuration, or None after printing every problem as `key: message`."""
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return None


def _cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args, build_serve_overrides(args))
    if config is None:
        return EXIT_CONFIG
    from sandbox_supervisor.daemon.app import serve_main

    return serve_main(config)


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args, {})
    if config is None:
        return EXIT_CONFIG
    problem = _jwks_problem(config.authority.jwks_file)
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_CONFIG
    print(json.dumps(masked_dict(config), indent=2))
    return EXIT_OK


def _jwks_problem(path: Path) -> str | None:
    """The daemon exits 2 at start on an unusable JWKS file; check-config says so first, in
    the same words (auth/keyring.py reads the file for both)."""
    from sandbox_supervisor.daemon.auth.keyring import KeyRing, unusable_jwks
    from sandbox_supervisor.protocol.authority import JwksError

    try:
        KeyRing(path)
    except (OSError, JwksError) as exc:
        return config_problem(JWKS_FILE_KEY, unusable_jwks(path, exc))
    return None


def _cmd_reset_state(args: argparse.Namespace) -> int:
    import time

    from sandbox_supervisor.daemon.state.integrity import move_aside, reset_stamp
    from sandbox_supervisor.daemon.state.store import DB_FILENAME

    overrides = {} if args.state_dir is None else {"paths.state_dir": args.state_dir}
    config = _load(args, overrides)
    if config is None:
        return EXIT_CONFIG
    state_dir = Path(config.paths.state_dir)
    if not state_dir.is_dir():
        _error(f"{state_dir} is not a directory")
        return EXIT_CONFIG
    try:
        moved = move_aside(state_dir, DB_FILENAME, reset_stamp(time.time()))
    except OSError as exc:
        _error(f"cannot move the state in {state_dir} aside: {exc}")
        return EXIT_CONFIG
    if moved is None:
        print(f"nothing to move in {state_dir}: the next start initialises a new state")
    else:
        print(f"moved the state of {state_dir} to {moved}: the next start initialises a new state")
    return EXIT_OK


def _cmd_keys_generate(args: argparse.Namespace) -> int:
    from sandbox_supervisor.daemon.ops.keys import write_key_pair

    try:
        key_path, jwks_path = write_key_pair(args.out_dir, args.kid, force=args.force)
    except (FileExistsError, ValueError) as exc:
        _error(str(exc))
        return EXIT_CONFIG
    except OSError as exc:
        _error(f"cannot write keys in {args.out_dir}: {exc.strerror}")
        return EXIT_CONFIG
    print(f"wrote {key_path} (private, mode 0600) and {jwks_path} (public)")
    return EXIT_OK


def _cmd_keys_mint(args: argparse.Namespace) -> int:
    from sandbox_supervisor.daemon.ops.keys import (
        DEFAULT_LIFETIME_S,
        KeyFileError,
        claim_warnings,
        load_signing_jwk,
        mint_assertion,
    )

    try:
        jwk = load_signing_jwk(args.key)
    except KeyFileError as exc:
        _error(str(exc))
        return EXIT_CONFIG
    try:
        claims = json.loads(args.claims)
    except ValueError:
        _error("--claims is not JSON")
        return EXIT_CONFIG
    if not isinstance(claims, dict):
        _error("--claims must be a JSON object")
        return EXIT_CONFIG
    lifetime = DEFAULT_LIFETIME_S if args.lifetime is None else args.lifetime
    try:
        token = mint_assertion(jwk, claims, lifetime_s=lifetime)
    except ValueError as exc:
        _error(str(exc))
        return EXIT_CONFIG
    # On stderr, so `$(sandbox-supervisor keys mint …)` still captures the token alone.
    for warning in claim_warnings(claims):
        _error(f"warning: {warning}")
    print(token)
    return EXIT_OK


def _cmd_onboard_template(args: argparse.Namespace) -> int:
    from sandbox_supervisor.daemon.ops.onboarding import run

    return run(args)


def _cmd_install_units(args: argparse.Namespace) -> int:
    from sandbox_supervisor.daemon.ops.units import InstallUnitsError, install_units

    try:
        installed = install_units(args.root, force=args.force)
    except InstallUnitsError as exc:
        _error(str(exc))
        return EXIT_CONFIG
    for item in installed:
        print(item.describe())
    return EXIT_OK
