"""The TypeScript client (clients/typescript/): its generated types are current, and its own
tests (Node's test runner) pass, the client ones against a real daemon started as users
start it (`python -m sandbox_supervisor.daemon serve`), over TCP and a unix socket.

Node 20+ and npm are needed. Outside CI a machine without them skips with that reason; in CI
(`CI=true`, where .ci/run installs them) their absence fails. `npm ci` runs only when
node_modules is missing or package-lock.json changed since the last install (a stamp file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from sandbox_supervisor.daemon.config import WebSocketConfig
from sandbox_supervisor.protocol import typescript_export
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.daemon import DaemonProcess, make_layout, running_daemon

REPO = Path(__file__).resolve().parents[1]
CLIENT_DIR = REPO / "clients" / "typescript"
LOCK_FILE = CLIENT_DIR / "package-lock.json"
INSTALL_STAMP = CLIENT_DIR / "node_modules" / ".installed-lock-sha256"
MIN_NODE_MAJOR = 20
INSTALL_TIMEOUT_S = 300
BUILD_TIMEOUT_S = 120
NODE_TESTS_TIMEOUT_S = 120
NODE_TEST_TIMEOUT_MS = 30_000
DAEMON_POLL_S = 0.02  # how often the stopping test looks whether the daemon's run has exited  # one node test; a hang fails it with its name, not the whole run
UNIT_TESTS = ("policy.test.js", "contract.test.js", "store.test.js", "schemas.test.js", "session.test.js")
DAEMON_TESTS = ("client.test.js",)
STOPPING_TESTS = ("stopping.test.js",)
# The stop's grace before its SIGKILL (exec.kill_grace_ms): the stop handles frames while it
# waits, and the node test sends its call in that window once the held command saw SIGTERM.
# Long enough for a loaded machine; the stop lasts about this long.
STOPPING_GRACE_MS = 5_000


def _node_problem() -> str | None:
    """Why Node cannot run here, or None."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "node and npm are not installed (.ci/run installs Node 20)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    if major < MIN_NODE_MAJOR:
        return f"node {version} is older than {MIN_NODE_MAJOR}"
    return None


def _lock_digest() -> str:
    return hashlib.sha256(LOCK_FILE.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built_client() -> Path:
    """clients/typescript installed (npm ci, when needed) and compiled (tsc)."""
    problem = _node_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the TypeScript client's tests: {problem}")
        pytest.skip(problem)
    digest = _lock_digest()
    if not INSTALL_STAMP.is_file() or INSTALL_STAMP.read_text() != digest:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=CLIENT_DIR, check=True, timeout=INSTALL_TIMEOUT_S,
        )
        INSTALL_STAMP.write_text(digest)
    completed = subprocess.run(
        [str(CLIENT_DIR / "node_modules" / ".bin" / "tsc"), "-p", "tsconfig.json"],
        cwd=CLIENT_DIR, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return CLIENT_DIR / "dist" / "test"


def test_generated_types_are_current() -> None:
    assert not typescript_export.drifted(typescript_export.DEFAULT_OUT_FILE), (
        "run: python -m sandbox_supervisor.protocol.typescript_export"
    )


def test_generated_types_name_every_frame_and_code() -> None:
    text = typescript_export.render()
    for name in ("ToolResultEvent", "ExecOutputEvent", "ServerFrame", "ClientFrame", "FrameErrorCode", "ToolErrorCode"):
        assert f"export type {name} " in text or f"export interface {name} " in text, name
    assert '  | "journal_full"' in text
    assert "result: ToolResultsByName[T]" in text  # `result` typed per tool
    assert "Kind1" not in text and "unknown;" not in text.split("interface ToolError {")[0]


def test_exported_message_limit_is_the_daemons_default() -> None:
    """The client refuses frames over DEFAULT_MAX_MESSAGE_BYTES before sending them: it must be
    the daemon's websocket.max_message_bytes default, or the client would either send frames
    that close the socket 1009 or refuse frames the daemon takes."""
    default = WebSocketConfig.model_fields["max_message_bytes"].default
    assert f"export const DEFAULT_MAX_MESSAGE_BYTES = {default};" in typescript_export.render()


README = REPO / "README.md"
# Written inside the package (dist/ is not committed) so that the example's import of the
# package's own name resolves to the build, as it does in a project that installed it.
README_EXAMPLE = CLIENT_DIR / "dist" / "readme" / "example.ts"
README_TS_BLOCK = re.compile(r"^```ts\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_readme_example_compiles(built_client: Path) -> None:
    section = README.read_text().split("## Clients\n", 1)[1].split("\n## ", 1)[0]
    blocks = README_TS_BLOCK.findall(section)
    assert len(blocks) == 1, "the README's Clients section has one TypeScript example"
    assert '"@sandbox-supervisor/client"' in blocks[0]
    README_EXAMPLE.parent.mkdir(parents=True, exist_ok=True)
    README_EXAMPLE.write_text(blocks[0])
    completed = subprocess.run(
        [
            str(CLIENT_DIR / "node_modules" / ".bin" / "tsc"), "--ignoreConfig", "--noEmit", "--strict", "--skipLibCheck",
            "--target", "ES2022", "--module", "NodeNext", "--moduleResolution", "NodeNext", "--types", "node",
            str(README_EXAMPLE),
        ],
        cwd=CLIENT_DIR, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


async def _node_tests(directory: Path, files: tuple[str, ...], env: dict[str, str]) -> None:
    completed = await trio.run_process(
        ["node", "--test", "--test-concurrency=1", f"--test-timeout={NODE_TEST_TIMEOUT_MS}", *(str(directory / name) for name in files)],
        cwd=CLIENT_DIR,
        env={**os.environ, **env},
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    output = completed.stdout.decode(errors="replace") + completed.stderr.decode(errors="replace")
    print(output)  # shown by pytest -s, or with a failure
    assert completed.returncode == 0, output[-20000:]
    assert "# fail 0" in output and "# skipped 0" in output, output[-5000:]


async def test_unit_tests_and_ajv_strict_on_every_schema(built_client: Path) -> None:
    with trio.fail_after(NODE_TESTS_TIMEOUT_S):
        await _node_tests(built_client, UNIT_TESTS, {"SUPERVISOR_SCHEMAS": str(REPO / "protocol" / "schemas")})


def _daemon_env(process: DaemonProcess, tmp_path: Path) -> dict[str, str]:
    """What support.ts's daemon() reads: the daemon's addresses, identity and signing key."""
    layout = process.layout
    jwk_file = tmp_path / "signing.jwk.json"
    jwk_file.write_text(json.dumps(layout.authority.signing_jwk()))
    return {
        "SUPERVISOR_TCP": str(process.running.tcp),
        "SUPERVISOR_UNIX": str(layout.unix_socket),
        "SUPERVISOR_SANDBOX_ID": layout.sandbox_id,
        "SUPERVISOR_WORKSPACE": str(layout.workspace),
        "SUPERVISOR_JWK": str(jwk_file),
        "SUPERVISOR_ISSUER": layout.authority.issuer,
        "SUPERVISOR_AUDIENCE": layout.authority.audience,
        "SUPERVISOR_SCHEMAS": str(REPO / "protocol" / "schemas"),
    }


async def test_client_against_a_real_daemon_over_tcp_and_unix(built_client: Path, tmp_path: Path) -> None:
    layout = make_layout(tmp_path / "daemon", authority=LoopbackAuthority())
    async with running_daemon(layout) as process:
        with trio.fail_after(NODE_TESTS_TIMEOUT_S):
            await _node_tests(built_client, DAEMON_TESTS, _daemon_env(process, tmp_path))


async def test_client_sends_a_stopped_call_again_to_the_next_supervisor(built_client: Path, tmp_path: Path) -> None:
    """stopping.test.ts SIGTERMs the daemon during a call and gets `supervisor_stopping`;
    here the daemon is started again on the same state once that run has exited (as systemd
    would), and the node test's call made again with the same key runs there."""
    layout = make_layout(tmp_path / "daemon", authority=LoopbackAuthority(), exec={"kill_grace_ms": STOPPING_GRACE_MS})
    async with running_daemon(layout) as process:
        assert process.proc is not None
        env = {**_daemon_env(process, tmp_path), "SUPERVISOR_PID": str(process.proc.pid)}

        async def start_again_after_the_stop() -> None:
            while process.returncode is None:
                await trio.sleep(DAEMON_POLL_S)
            assert process.returncode == 0, process.log_text()[-5000:]
            await process.start()

        with trio.fail_after(NODE_TESTS_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_again_after_the_stop)
                try:
                    await _node_tests(built_client, STOPPING_TESTS, env)
                finally:
                    nursery.cancel_scope.cancel()
        assert process.returncode is None, "the daemon was started again for the retried call"
