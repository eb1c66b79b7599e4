"""Prometheus metrics of ``treerl serve`` (``GET /metrics``, through ``prometheus_client``).

:class:`ServeMetrics` owns one registry per served app (not the process-wide default, so
several servers in one process keep apart). At each scrape it reads the loop's counters
(``treerl_loop_*``: :class:`~treerl.serve.loop.LoopStats`) and the engine's
(``treerl_engine_*``: :class:`~treerl.rollout.RolloutStats`, summed over the loop's
streams), plus the weight version and the requests waiting or running. Other modules
register their own counters with :meth:`ServeMetrics.counter`; the chat front end's tool-call counts
are ``treerl_chat_tool_calls_*_total`` (e.g. ``treerl_chat_tool_calls_malformed_total``); HTTP responses
are counted by route and status.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# RolloutStats fields that are not monotonic counters
_ENGINE_GAUGES = {"kv_slots": "most K/V token slots held by one stream"}


class _LoopCollector:
    def __init__(self, read: Callable[[], tuple[Any, Any, int, int]]):
        self.read = read

    def collect(self) -> Iterator[Metric]:
        loop_stats, engine_stats, version, busy = self.read()
        for f in dataclasses.fields(loop_stats):
            yield CounterMetricFamily(f"treerl_loop_{f.name}", f"EngineLoop counter {f.name}",
                                      value=getattr(loop_stats, f.name))
        for f in dataclasses.fields(engine_stats):
            value = getattr(engine_stats, f.name)
            if f.name in _ENGINE_GAUGES:
                yield GaugeMetricFamily(f"treerl_engine_{f.name}", _ENGINE_GAUGES[f.name], value=value)
            else:
                yield CounterMetricFamily(f"treerl_engine_{f.name}", f"RolloutEngine counter {f.name} "
                                          "(summed over the loop's streams)", value=value)
        yield GaugeMetricFamily("treerl_weight_version", "the served weight version", value=version)
        yield GaugeMetricFamily("treerl_busy_requests", "requests waiting or running", value=busy)


class _CountersCollector:
    """``treerl_<prefix>_<key>_total`` for each key of ``read()`` (counts), at scrape time."""

    def __init__(self, prefix: str, documentation: str, read: Callable[[], dict[str, int]]):
        self.prefix, self.documentation, self.read = prefix, documentation, read

    def collect(self) -> Iterator[Metric]:
        for key, value in self.read().items():
            yield CounterMetricFamily(f"treerl_{self.prefix}_{key}", f"{self.documentation}: {key}", value=value)


class ServeMetrics:
    """The metrics of one app. ``read()`` returns ``(LoopStats, RolloutStats, weight version,
    busy requests)`` at scrape time."""

    def __init__(self, read: Callable[[], tuple[Any, Any, int, int]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LoopCollector(read))
        self._counters: dict[str, Counter] = {}
        self._lock = threading.Lock()
        self.http_responses = self.counter("http_responses", "HTTP responses by route and status",
                                           ("route", "status"))

    def counter(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Counter:
        """The counter ``treerl_<name>_total`` (created on first use; the same object after)."""
        with self._lock:
            c = self._counters.get(name)
            if c is None:
                c = Counter(f"treerl_{name}", documentation, labelnames, registry=self.registry)
                self._counters[name] = c
            return c

    def counters_from(self, prefix: str, documentation: str, read: Callable[[], dict[str, int]]) -> None:
        """Export the counts ``read()`` returns at each scrape as ``treerl_<prefix>_<key>_total``."""
        self.registry.register(_CountersCollector(prefix, documentation, read))

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape reads."""
        return generate_latest(self.registry)
