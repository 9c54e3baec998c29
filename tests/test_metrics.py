"""Prometheus metrics: the series after increments, values read at scrape time, one registry
per daemon, and output a Prometheus parser accepts."""

from __future__ import annotations

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
