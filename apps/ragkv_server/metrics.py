"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms with labels."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("ragkv.service")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, labels=()):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple, float] = {}

    def inc(self, *labels: str, n: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + n

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0.0)]
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A gauge read at scrape time from ``fn`` (returning a number, or ``{label values: number}``)."""

    kind = "gauge"

    def __init__(self, name, help_text, fn: Callable[[], float | dict], labels=()):
        super().__init__(name, help_text, labels)
        self.fn = fn
        self._last_warn = -1e18

    def render(self) -> list[str]:
        try:
            got = self.fn()
        except Exception as e:  # noqa: BLE001 - a failing source (e.g. Redis down) omits the sample
            now = time.monotonic()
            if now - self._last_warn >= 60.0:  # said, at most once a minute per gauge
                self._last_warn = now
                log.warning("metric %s omitted: its source failed: %s: %s", self.name, type(e).__name__, e)
            return self.header()
        items = got.items() if isinstance(got, dict) else [((), got)]
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, labels=(), buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        self._data: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            d = self._data.setdefault(labels, [0] * len(self.buckets) + [0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    d[i] += 1
            d[-2] += value
            d[-1] += 1

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        out = self.header()
        for k, d in items:
            for b, c in zip(self.buckets, d, strict=False):
                le = 'le="' + _num(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, k, le)} {c}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_labels(self.labelnames, k, inf)} {d[-1]}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, k)} {_num(d[-2])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, k)} {d[-1]}")
        return out


class Registry:
    """Metrics of one app, rendered in registration order."""

    def __init__(self):
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"
