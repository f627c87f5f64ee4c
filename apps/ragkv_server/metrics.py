"""The service's Prometheus metrics on ``prometheus-client``: one registry per app, exposition format 0.0.4.

Counters and histograms are the library's; gauges read at scrape time (the index, the store, the
pools) are a custom collector, the library's way to expose values another object owns. The calls the
service makes (``inc(*labels, n=)``, ``observe(value, *labels)``) stay as they were; ``_created``
series are not exposed, so the metric names are the ones the service has always shown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("ragkv.service")

#: the ``/metrics`` content type (text format 0.0.4, which every Prometheus scrapes)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# the service shows counters as ``name_total`` only (no ``name_created`` beside each): as before
prometheus_client.disable_created_metrics()


class Counter:
    """A labelled counter: ``inc(*label_values, n=1)``."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, tuple(labels)
        self._metric = prometheus_client.Counter(name, help_text, self.labelnames, registry=None)

    def inc(self, *labels: str, n: float = 1.0) -> None:
        (self._metric.labels(*labels) if labels else self._metric).inc(n)

    def collector(self) -> Collector:
        return self._metric


class Histogram:
    """A labelled histogram: ``observe(value, *label_values)``."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ) -> None:
        self.name, self.help, self.labelnames = name, help_text, tuple(labels)
        self._metric = prometheus_client.Histogram(
            name, help_text, self.labelnames, buckets=tuple(buckets), registry=None
        )

    def observe(self, value: float, *labels: str) -> None:
        (self._metric.labels(*labels) if labels else self._metric).observe(value)

    def collector(self) -> Collector:
        return self._metric


class Gauge(Collector):
    """A gauge read at scrape time from ``fn`` (a number, or ``{label values: number}``); a failing
    source (e.g. Redis down) omits the sample and is logged at most once a minute."""

    def __init__(
        self, name: str, help_text: str, fn: Callable[[], float | dict], labels: tuple[str, ...] = ()
    ) -> None:
        self.name, self.help, self.labelnames, self.fn = name, help_text, tuple(labels), fn
        self._last_warn = -1e18

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.help, labels=self.labelnames)
        try:
            got = self.fn()
        except Exception as e:  # noqa: BLE001 - the sample is omitted, the scrape goes on
            now = time.monotonic()
            if now - self._last_warn >= 60.0:
                self._last_warn = now
                log.warning("metric %s omitted: its source failed: %s: %s", self.name, type(e).__name__, e)
            yield family
            return
        for labels, value in got.items() if isinstance(got, dict) else [((), got)]:
            family.add_metric([str(v) for v in labels], float(value))
        yield family

    def describe(self) -> list[Metric]:
        return []  # read at scrape time: nothing to check at registration

    def collector(self) -> Collector:
        return self


class Registry:
    """The metrics of one app (a ``CollectorRegistry`` of its own), rendered in registration order."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def add(self, metric):
        self.registry.register(metric.collector())
        return metric

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()
