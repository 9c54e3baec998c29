"""What must never leak, and what commands must not inherit: a canary secret in the daemon's
environment, in the assertion and in call environments never reaches logs, frames or the
health route; commands do not inherit the daemon's OOM protection."""

from __future__ import annotations

import json
import os
import re

import trio

from sandbox_supervisor.testing.client import http_request
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

CANARY = "canary-7d1e0c9b"
EVENT_NAME = re.compile(r"""(?:log|bound_log|self\.log)\.(?:info|warning|error|exception|debug)\(\s*"([a-z_.-]+)"|safe_log\(\s*log,\s*"([a-z_.-]+)\"""")


async def test_canary_never_reaches_logs_frames_or_health(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    frames = []
    async with running_daemon(layout, env={"DAEMON_SECRET": CANARY}) as process:
        running = process.running
        client = running.client()
        async with client.connect() as session:
            body = {
                "sessionId": client.session_id,
                "agent": {"cwd": str(layout.workspace), "profile": "default", "env": {"AGENT_SECRET": CANARY}},
                "repositories": [],
            }
            await session.bootstrap(body)
            result = await session.call_and_wait(
                "execute_shell_command",
                {"command": "true", "env": {"CALL_SECRET": CANARY}},
                idempotency_key="quiet",
            )
            assert result["ok"] is True
            env_dump = await session.call_and_wait(
                "execute_shell_command", {"command": "env"}, idempotency_key="env"
            )
            health = await http_request(running.tcp, "GET", "/healthz")
            frames = list(client.state.events.values())
        # The assertion itself: a fresh token carries the canary as its jti.
        token = client.mint(generation=99, attempt_id="a-canary", ack_floor=0, jti=CANARY)
        async with client.connect(generation=99, attempt_id="a-canary", ack_floor=0, assertion=token):
            pass
    assert process.returncode == 0
    log = process.log_text()
    assert log, "the daemon logged nothing"
    assert CANARY not in log
    assert token not in log
    assert CANARY not in health.body.decode()
    # The daemon's own secret never reaches a command; the agent's value does (it is its env).
    out = env_dump["result"]["stdout"]["head"]
    assert "DAEMON_SECRET" not in out and f"AGENT_SECRET={CANARY}" in out
    assert all("DAEMON_SECRET" not in json.dumps(frame) for frame in frames)
    # Every log line is a JSON object with the fixed fields.
    events = [json.loads(line) for line in log.splitlines()]
    assert all({"event", "level", "timestamp"} <= set(event) for event in events)
    finished = [e for e in events if e["event"] == "tool.finished"]
    assert len(finished) == 2
    for event in finished:
        assert event["tool"] == "execute_shell_command" and event["ok"] is True
        assert event["exit_code"] == 0 and isinstance(event["duration_ms"], (int, float))
        assert event["session_id"] == "session-1" and event["call_id"]


async def test_commands_do_not_inherit_the_daemons_oom_protection(tmp_path, authority):
    from sandbox_supervisor.daemon.runtime.oom import COMMAND_OOM_SCORE_ADJ, read_oom_score_adj

    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        daemon_value = read_oom_score_adj(process.proc.pid)
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            result = await session.call_and_wait(
                "execute_shell_command",
                {"command": "cat /proc/self/oom_score_adj; bash -c 'cat /proc/self/oom_score_adj'"},
                idempotency_key="oom",
            )
    assert process.returncode == 0
    values = [int(v) for v in result["result"]["stdout"]["head"].split()]
    assert values == [COMMAND_OOM_SCORE_ADJ, COMMAND_OOM_SCORE_ADJ]
    assert daemon_value != COMMAND_OOM_SCORE_ADJ


def test_every_log_event_is_in_the_readme_vocabulary():
    """The README documents a fixed vocabulary of log events; a new event name in the code
    must be added there."""
    root = os.path.dirname(os.path.dirname(__file__))
    names = set()
    for folder, _, files in os.walk(os.path.join(root, "supervisor")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as handle:
                    for match in EVENT_NAME.finditer(handle.read()):
                        names.add(match.group(1) or match.group(2))
    with open(os.path.join(root, "README.md")) as handle:
        readme = handle.read()
    assert len(names) > 20
    missing = sorted(name for name in names if f"`{name}`" not in readme)
    assert missing == []


async def test_a_malformed_head_never_logs_its_header_values(tmp_path, authority):
    """h11 quotes the line it refuses; an assertion sent with a space before the colon must
    not reach the log through that quote."""
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        stream = await process.running.tcp.open_stream()
        await stream.send_all(
            b"GET /v1/control HTTP/1.1\r\nHost: localhost\r\n"
            b"x-coding-agent-control-authority : eyJ" + CANARY.encode() + b"\r\n\r\n"
        )
        with trio.fail_after(10):
            answer = b""
            while chunk := await stream.receive_some(4096):
                answer += chunk
        await stream.aclose()
        assert answer.startswith(b"HTTP/1.1 400")
        with trio.fail_after(10):
            while not any(e.get("event") == "http.bad_request" for e in process.log_events()):
                await trio.sleep(0.02)
    assert process.returncode == 0
    assert CANARY not in process.log_text()
