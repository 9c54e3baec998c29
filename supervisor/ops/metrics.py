"""Prometheus metrics for `GET /metrics` (off by default: websocket.metrics_enabled).

Each daemon owns a `CollectorRegistry` of its own rather than prometheus_client's global one,
so several daemons in one test process (or a daemon and a library that registers globally)
never clash over a series name.

Values that already live in the store (journal head, ack floor) are not copied on every
change: a collector reads them through callables when /metrics is scraped, so the hot paths
do no metrics bookkeeping for them. Counters are incremented where things happen.

Metrics are telemetry: nothing here may raise into the daemon. A callable that fails during a
scrape leaves its series out of that scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAMESPACE = "sandbox_supervisor"


ValueSource = Callable[[], int | float]


class SupervisorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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

    def tool_call(self, tool: str, outcome: str) -> None:
        self.tool_calls.labels(tool=tool, outcome=outcome).inc()

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
        self._journal.sources = {
            "journal_last_seq": ("Seq of the newest journaled event.", last_seq),
            "journal_ack_floor": ("Highest seq the client has acknowledged.", ack_floor),
        }

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
