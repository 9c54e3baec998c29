"""Prometheus metrics: the series after increments, values read at scrape time, one registry
per daemon, and output a Prometheus parser accepts."""

from __future__ import annotations

import trio
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sandbox_supervisor.daemon.edge.http_front import METRICS_CONTENT_TYPE
from sandbox_supervisor.daemon.ops.metrics import SupervisorMetrics
from sandbox_supervisor.daemon.telemetry import UPGRADE_ACCEPTED


def samples(metrics: SupervisorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed back from the rendered text."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode("utf-8")):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_render_contains_every_series_after_increments() -> None:
    metrics = SupervisorMetrics()
    metrics.upgrade(UPGRADE_ACCEPTED)
    metrics.upgrade(UPGRADE_ACCEPTED)
    metrics.upgrade("invalid_assertion")
    metrics.tool_call("read_file", "success")
    metrics.tool_call("execute_shell_command", "timeout")
    metrics.process_started()
    metrics.process_started()
    metrics.process_exited()
    metrics.events_replayed(7)
    metrics.events_replayed(0)  # nothing replayed is not an increment
    metrics.output_spooled(4096)
    metrics.output_spooled(10)
    metrics.observe_journal(lambda: 42, lambda: 40)

    text = metrics.render().decode("utf-8")
    for line in (
        'sandbox_supervisor_upgrades_total{outcome="accepted"} 2.0',
        'sandbox_supervisor_upgrades_total{outcome="invalid_assertion"} 1.0',
        'sandbox_supervisor_tool_calls_total{outcome="success",tool="read_file"} 1.0',
        'sandbox_supervisor_tool_calls_total{outcome="timeout",tool="execute_shell_command"} 1.0',
        "sandbox_supervisor_running_processes 1.0",
        "sandbox_supervisor_replayed_events_total 7.0",
        "sandbox_supervisor_spooled_bytes_total 4106.0",
        "sandbox_supervisor_journal_last_seq 42.0",
        "sandbox_supervisor_journal_ack_floor 40.0",
    ):
        assert line in text.splitlines(), line
    assert "# TYPE sandbox_supervisor_upgrades_total counter" in text
    assert "# TYPE sandbox_supervisor_running_processes gauge" in text
    assert "# TYPE sandbox_supervisor_journal_last_seq gauge" in text


def test_output_parses_as_prometheus_text_and_names_the_content_type() -> None:
    metrics = SupervisorMetrics()
    metrics.tool_call("apply_file_patch", "success")
    metrics.observe_journal(lambda: 3, lambda: 1)
    parsed = samples(metrics)
    assert parsed[("sandbox_supervisor_tool_calls_total", (("outcome", "success"), ("tool", "apply_file_patch")))] == 1
    assert parsed[("sandbox_supervisor_journal_last_seq", ())] == 3
    assert METRICS_CONTENT_TYPE == b"text/plain; version=0.0.4; charset=utf-8"


def test_journal_gauges_are_read_from_callables_at_scrape_time() -> None:
    metrics = SupervisorMetrics()
    state = {"last_seq": 5, "ack_floor": 2}
    calls = []

    def last_seq() -> int:
        calls.append("last_seq")
        return state["last_seq"]

    metrics.observe_journal(last_seq, lambda: state["ack_floor"])
    assert calls == []  # registering reads nothing
    assert samples(metrics)[("sandbox_supervisor_journal_last_seq", ())] == 5
    # The store moves on; nobody tells the metrics: the next scrape sees it anyway.
    state.update(last_seq=9, ack_floor=9)
    scraped = samples(metrics)
    assert scraped[("sandbox_supervisor_journal_last_seq", ())] == 9
    assert scraped[("sandbox_supervisor_journal_ack_floor", ())] == 9
    assert calls == ["last_seq", "last_seq"]  # once per scrape


def test_a_failing_source_drops_its_series_not_the_scrape() -> None:
    metrics = SupervisorMetrics()
    metrics.upgrade(UPGRADE_ACCEPTED)

    def broken() -> int:
        raise RuntimeError("store closed")

    metrics.observe_journal(broken, lambda: 4)
    text = metrics.render().decode("utf-8")
    assert "sandbox_supervisor_journal_last_seq" not in text
    assert "sandbox_supervisor_journal_ack_floor 4.0" in text.splitlines()
    assert 'sandbox_supervisor_upgrades_total{outcome="accepted"} 1.0' in text.splitlines()


def test_journal_gauges_are_absent_until_observed() -> None:
    text = SupervisorMetrics().render().decode("utf-8")
    assert "journal_last_seq" not in text
    assert "sandbox_supervisor_running_processes 0.0" in text.splitlines()


def test_each_daemon_has_its_own_registry() -> None:
    first, second = SupervisorMetrics(), SupervisorMetrics()  # would clash on one registry
    first.upgrade(UPGRADE_ACCEPTED)
    assert samples(first)[("sandbox_supervisor_upgrades_total", (("outcome", "accepted"),))] == 1
    assert ("sandbox_supervisor_upgrades_total", (("outcome", "accepted"),)) not in samples(second)
    assert b"sandbox_supervisor" not in generate_latest(REGISTRY)  # the global one is untouched



async def test_metrics_route_of_a_running_daemon(tmp_path, authority):
    """GET /metrics on the daemon's own listeners, after real traffic of every kind counted."""
    import re

    import pytest as _pytest

    from sandbox_supervisor.testing.client import UpgradeRejected, http_request
    from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

    layout = make_layout(tmp_path / "d", authority=authority, websocket={"metrics_enabled": True})
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("execute_shell_command", {"command": "echo hi"}, idempotency_key="m1")
            await session.call_and_wait("read_file", {"path": "missing.txt"})
        async with client.connect(ack_floor=0) as session:  # everything is replayed
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("read_file", {"path": "missing.txt"})
        with _pytest.raises(UpgradeRejected):
            async with client.connect(generation=1):
                pass
        response = await http_request(daemon.unix, "GET", "/metrics")
    assert response.status == 200
    assert response.header("content-type").startswith("text/plain")
    text = response.body.decode()

    def value(pattern: str) -> float:
        match = re.search(r"^" + pattern + r" ([0-9.e+]+)$", text, re.MULTILINE)
        assert match, pattern
        return float(match.group(1))

    assert value(r'sandbox_supervisor_upgrades_total\{outcome="accepted"\}') == 2
    assert value(r'sandbox_supervisor_upgrades_total\{outcome="stale_generation"\}') == 1
    assert value(r'sandbox_supervisor_tool_calls_total\{outcome="success",tool="execute_shell_command"\}') == 1
    assert value(r'sandbox_supervisor_tool_calls_total\{outcome="not_found",tool="read_file"\}') == 2
    assert value(r"sandbox_supervisor_running_processes") == 0
    assert value(r"sandbox_supervisor_spooled_bytes_total") == 3
    assert value(r"sandbox_supervisor_replayed_events_total") >= 5
    last_seq = value(r"sandbox_supervisor_journal_last_seq")
    assert last_seq >= 6


# --- the daemon's own series, scraped from a daemon started as users start it --------------

import json
import platform
import time

import pytest

from sandbox_supervisor.daemon.version import installed_version
from sandbox_supervisor.testing.client import Endpoint, http_request
from sandbox_supervisor.testing.daemon import make_layout, running_daemon

DURATION = "sandbox_supervisor_tool_call_duration_seconds"
# A daemon's start, seen from the test: well within this many seconds of the scrape.
START_TIME_SLACK_S = 300


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def scrape(endpoint: Endpoint) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await http_request(endpoint, "GET", "/metrics")
    assert response.status == 200
    text = response.body.decode()
    # No `_created` series, in any family (prometheus_client adds them unless disabled).
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert names and not [name for name in names if name.endswith("_created")]
    return scraped(text)


async def test_process_build_duration_and_disk_series_of_a_running_daemon(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"metrics_enabled": True})
    async with running_daemon(layout) as process:
        running = process.running
        before = await scrape(running.tcp)
        async with running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("execute_shell_command", {"command": "echo hi"}, idempotency_key="m1")
        after = await scrape(running.tcp)
        now = time.time()

    shell = (("tool", "execute_shell_command"),)
    assert before.get((f"{DURATION}_count", shell), 0) == 0
    assert after[(f"{DURATION}_count", shell)] == 1
    assert after[(f"{DURATION}_bucket", (("le", "+Inf"), *shell))] == 1
    assert 0 < after[(f"{DURATION}_sum", shell)] < 60
    assert after[(f"{DURATION}_bucket", (("le", "3600.0"), *shell))] == 1  # the widest finite bucket

    assert after[("process_resident_memory_bytes", ())] > 1024 * 1024
    assert after[("process_open_fds", ())] > 0
    assert after[("process_max_fds", ())] >= after[("process_open_fds", ())]
    assert after[("process_cpu_seconds_total", ())] > 0
    assert now - START_TIME_SLACK_S < after[("process_start_time_seconds", ())] <= now

    build = [labels for (name, labels) in after if name == "sandbox_supervisor_build_info"]
    assert build == [(("python", platform.python_version()), ("version", installed_version()))]
    assert after[("sandbox_supervisor_build_info", build[0])] == 1

    database = layout.state_dir / "supervisor.sqlite3"
    assert after[("sandbox_supervisor_journal_disk_bytes", ())] >= database.stat().st_size > 0
    assert after[("sandbox_supervisor_spool_disk_bytes", ())] == len("hi\n")
    assert before[("sandbox_supervisor_spool_disk_bytes", ())] == 0


async def test_a_scrape_never_walks_the_spools(tmp_path, authority, monkeypatch):
    """The spools' size is the budget's running figure: a scrape costs no directory walk,
    however many spool files there are (the walk happens at start and at prunes only)."""
    from sandbox_supervisor.daemon.runtime import command_output
    from sandbox_supervisor.testing.daemon import in_process_daemon

    walks = []
    real = command_output.spool_usage
    monkeypatch.setattr(command_output, "spool_usage", lambda state_dir: walks.append(state_dir) or real(state_dir))
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"metrics_enabled": True})
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.call_and_wait("execute_shell_command", {"command": "printf 12345"}, idempotency_key="w")
        walked = len(walks)
        assert walked >= 1  # the start measured them: the patch sees walks
        for _ in range(5):
            assert (await scrape(daemon.unix))[("sandbox_supervisor_spool_disk_bytes", ())] == 5
        assert len(walks) == walked


async def test_metrics_on_their_own_loopback_listener(tmp_path, authority):
    """websocket.metrics_listen: metrics there, and only there; nothing else on it."""
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"metrics_enabled": True, "metrics_listen": "127.0.0.1:0"}
    )
    async with running_daemon(layout) as process:
        listening = json.loads((layout.state_dir / "listening.json").read_text())
        [address] = listening["metrics"]
        metrics = Endpoint.parse(address)
        assert metrics.host_header.startswith("127.0.0.1:") and metrics != process.running.tcp
        response = await http_request(metrics, "GET", "/metrics")
        assert response.status == 200
        assert b"process_resident_memory_bytes" in response.body
        for endpoint in (process.running.tcp, process.running.unix):
            assert (await http_request(endpoint, "GET", "/metrics")).status == 404
            assert (await http_request(endpoint, "GET", "/healthz")).status == 200
        for path in ("/healthz", "/readyz", "/v1/control", "/"):
            refused = await http_request(metrics, "GET", path)
            assert (refused.status, refused.json()["error"]) == (404, "not_found")


async def test_without_a_metrics_listener_listening_json_has_no_metrics_entry(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"metrics_enabled": True})
    async with running_daemon(layout) as process:
        assert (await http_request(process.running.tcp, "GET", "/metrics")).status == 200
        assert set(json.loads((layout.state_dir / "listening.json").read_text())) == {"tcp", "unix"}


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            'metrics_enabled = true\nmetrics_listen = "0.0.0.0:9464"',
            "websocket.metrics_listen: '0.0.0.0:9464' is not a loopback address",
        ),
        (
            'metrics_enabled = true\nmetrics_listen = "localhost:9464"',
            "websocket.metrics_listen: 'localhost:9464' is not a loopback address",
        ),
        ('metrics_listen = "127.0.0.1:9464"', "websocket: metrics_listen needs metrics_enabled = true"),
    ],
)
def test_check_config_refuses_a_metrics_listener_off_loopback(tmp_path, authority, settings, message):
    import subprocess
    import sys

    layout = make_layout(tmp_path / "d", authority=authority)
    config = layout.write_config()
    config.write_text(config.read_text() + f"\n[websocket]\n{settings}\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SANDBOX_SUPERVISOR_")}
    result = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", "check-config", "--config", str(config)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 2
    assert any(line.startswith(message) for line in result.stderr.splitlines()), result.stderr


def test_no_created_series_and_build_info_from_the_given_version() -> None:
    metrics = SupervisorMetrics("9.9.9")
    metrics.tool_call("read_file", "success", 0.002)
    metrics.tool_call("read_file", "not_found")  # no duration given (a refusal that freed its key)
    found = samples(metrics)
    assert found[("sandbox_supervisor_build_info", (("python", platform.python_version()), ("version", "9.9.9")))] == 1
    assert found[(f"{DURATION}_count", (("tool", "read_file"),))] == 1
    assert found[(f"{DURATION}_bucket", (("le", "0.005"), ("tool", "read_file")))] == 1
    assert not [name for name, _ in found if name.endswith("_created")]


async def test_a_metrics_port_in_use_fails_the_start_naming_the_key(tmp_path, authority):
    import socket

    from sandbox_supervisor.testing.daemon import DaemonExitedEarly

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        layout = make_layout(
            tmp_path / "d", authority=authority, websocket={"metrics_enabled": True, "metrics_listen": address}
        )
        with pytest.raises(DaemonExitedEarly) as exited:
            async with running_daemon(layout):
                pass
    assert exited.value.returncode == 1
    [failure] = [json.loads(line) for line in exited.value.log.splitlines() if "supervisor.start_failed" in line]
    # Worded as a control listener's taken port is (supervisor/config.py, config_problem).
    assert failure["error"] == f"websocket.metrics_listen: {address} is in use: another process listens on it"


async def test_a_refusal_that_started_nothing_is_counted_but_not_timed(tmp_path, authority):
    """`too_many_processes` frees the key and ran nothing: its result is counted by code, and
    the duration histogram, which times what the daemon ran, does not observe it."""
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"metrics_enabled": True}, exec={"max_processes": 1}
    )
    shell = (("tool", "execute_shell_command"),)
    async with running_daemon(layout) as process:
        running = process.running
        async with running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            # Holds the one slot while the second call comes (ends by itself: no signal needed).
            busy = await session.call("execute_shell_command", {"command": "sleep 3"}, idempotency_key="m-busy")
            # Started before the second call is sent: two frames read together start their
            # calls' tasks in one scheduler batch, whose order trio does not promise.
            with trio.fail_after(10):
                await session.receive_until(lambda f: f["kind"] == "exec.started" and f["body"]["call_id"] == busy)
            refused = await session.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="m-2")
            assert refused["error"]["code"] == "too_many_processes"
            refused_only = await scrape(running.tcp)
            await session.result(busy, timeout=30)
            after = await scrape(running.tcp)
    refusals = (("outcome", "too_many_processes"), *shell)
    assert refused_only[("sandbox_supervisor_tool_calls_total", refusals)] == 1
    assert refused_only.get((f"{DURATION}_count", shell), 0) == 0
    assert after[(f"{DURATION}_count", shell)] == 1  # the command that ran
