"""Prometheus metrics for `GET /metrics` (off by default: websocket.metrics_enabled).

Each daemon owns a `CollectorRegistry` of its own rather than prometheus_client's global one,
so several daemons in one test process (or a daemon and a library that registers globally)
never clash over a series name.

Values that already live in the store (journal head, ack floor) are not copied on every
change: a collector reads them through callables when /metrics is scraped, so the hot paths
do no metrics bookkeeping for them. Counters are incremented where things happen.

Metrics are telemetry: nothing here may raise into the daemon. A callable that fails during a
scrape leaves its series out of that scrape.

Process metrics (`process_*`, the names every Prometheus client library uses) come from
prometheus_client's own ProcessCollector, which reads /proc/self at scrape time.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandbox_supervisor.daemon.version import UNKNOWN_VERSION, installed_version

NAMESPACE = "sandbox_supervisor"
# Tool calls last from a millisecond (a small read_file) to many minutes (a build, a test
# suite): prometheus_client's default buckets stop at 10 s, so these go on to an hour.
TOOL_CALL_DURATION_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)

# No `_created` series: prometheus_client adds one per counter and histogram child by default,
# a timestamp no dashboard uses, doubling the series count. The switch is process-wide (the
# library has no per-registry one); the daemon's process holds no other registry that wants
# them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in the library


ValueSource = Callable[[], int | float]


class SupervisorMetrics:
    def __init__(self, version: str | None = None) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        build = Info(
            "build",
            "The running build: the installed distribution's version and the Python version.",
            namespace=NAMESPACE,
            registry=self.registry,
        )
        build.info(
            {
                "version": version or installed_version() or UNKNOWN_VERSION,
                "python": platform.python_version(),
            }
        )
        self.tool_call_duration = Histogram(
            "tool_call_duration_seconds",
            "Tool calls' run time, from the start of the tool to its journaled tool.result, by tool.",
            ["tool"],
            namespace=NAMESPACE,
            registry=self.registry,
            buckets=TOOL_CALL_DURATION_BUCKETS_S,
        )
        self.upgrades = Counter(
            "upgrades",
            "WebSocket upgrade decisions, by outcome (accepted, or the rejection code).",
            ["outcome"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.tool_calls = Counter(
            "tool_calls",
            "Tool calls finished, by tool and outcome (success or the error code).",
            ["tool", "outcome"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.running_processes = Gauge(
            "running_processes",
            "Shell commands currently running.",
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.replayed_events = Counter(
            "replayed_events",
            "Journaled events sent again to a reconnecting client.",
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.spooled_bytes = Counter(
            "spooled_bytes",
            "Bytes of command output written to the spool.",
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self._journal = JournalCollector()
        self.registry.register(self._journal)

    # --- what happened (called where it happens) ----------------------------------------

    def upgrade(self, outcome: str) -> None:
        self.upgrades.labels(outcome=outcome).inc()

    def tool_call(self, tool: str, outcome: str, duration_s: float | None = None) -> None:
        self.tool_calls.labels(tool=tool, outcome=outcome).inc()
        if duration_s is not None:
            self.tool_call_duration.labels(tool=tool).observe(duration_s)

    def process_started(self) -> None:
        self.running_processes.inc()

    def process_exited(self) -> None:
        self.running_processes.dec()

    def events_replayed(self, count: int) -> None:
        if count > 0:
            self.replayed_events.inc(count)

    def output_spooled(self, nbytes: int) -> None:
        if nbytes > 0:
            self.spooled_bytes.inc(nbytes)

    # --- read at scrape time -------------------------------------------------------------

    def observe_journal(self, last_seq: ValueSource, ack_floor: ValueSource) -> None:
        """Report the journal's last seq and the client's ack floor by calling these at each
        scrape (for example `lambda: store.snapshot().local_event_max`)."""
        self._journal.sources.update(
            {
                "journal_last_seq": ("Seq of the newest journaled event.", last_seq),
                "journal_ack_floor": ("Highest seq the client has acknowledged.", ack_floor),
            }
        )

    def observe_disk(self, journal_bytes: ValueSource, spool_bytes: ValueSource) -> None:
        """Report disk usage by calling these at each scrape; each must be cheap (a stat or
        a running figure, never a walk of the spool directory)."""
        self._journal.sources.update(
            {
                "journal_disk_bytes": (
                    "Bytes on disk of the state database holding the journal (the file and its WAL).",
                    journal_bytes,
                ),
                "spool_disk_bytes": ("Bytes of command output in the spools, as the daemon counts them.", spool_bytes),
            }
        )

    def render(self) -> bytes:
        """The registry in the Prometheus text format (served as edge.http_front.METRICS_CONTENT_TYPE)."""
        return generate_latest(self.registry)


class JournalCollector(Collector):
    """Gauges whose values are read from callables when scraped."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[str, ValueSource]] = {}

    def describe(self) -> Iterator[Metric]:
        # Names are not known until observe_journal; an empty description keeps
        # registration from calling collect() (and the callables) early.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        for name, (documentation, source) in list(self.sources.items()):
            try:
                value = float(source())
            except Exception:  # noqa: BLE001 - a failing read must not fail the scrape
                continue
            family = GaugeMetricFamily(f"{NAMESPACE}_{name}", documentation)
            family.add_metric([], value)
            yield family
