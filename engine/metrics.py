"""Prometheus metrics of one server: request counters, token counters, TTFT, and the cache's own stats.

Each :class:`Metrics` owns a private ``CollectorRegistry`` (several servers may live in one test process).
Cache gauges are read from ``stats()`` at scrape time; the stats dict holds plain numbers that the worker
thread updates, so a scrape may see values from just before or just after a request — never torn ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# stats() key → (metric name, help); other numeric keys are exported as tiered_kv_cache_<key>
_NAMED = {
    "hot_entries": ("tiered_kv_hot_entries", "Entries in the in-memory tier"),
    "hot_bytes": ("tiered_kv_hot_bytes", "Bytes held by the in-memory tier"),
    "cold_entries": ("tiered_kv_cold_entries", "Entries in the disk tier"),
    "cold_bytes": ("tiered_kv_cold_bytes", "Bytes held by the disk tier"),
    "cold_spills": ("tiered_kv_spills", "Entries spilled from memory to disk"),
    "cold_drops": ("tiered_kv_spill_drops", "Spills dropped (write-behind queue pressure)"),
    "cold_drop_bytes": ("tiered_kv_spill_drop_bytes", "Bytes of spills dropped (queue pressure)"),
    "evictions": ("tiered_kv_hot_evictions", "Entries evicted from the in-memory tier"),
    "cold_load_bytes": ("tiered_kv_reload_bytes", "Bytes reloaded from the disk tier"),
    "cold_load_seconds": ("tiered_kv_reload_seconds", "Seconds spent reloading from the disk tier"),
    "shared_hits": (
        "tiered_kv_shared_lookup_hits",
        "Shared-tier (Redis) lookups that found an entry",
    ),
    "shared_fetches": (
        "tiered_kv_shared_fetches",
        "Entries fetched from the shared tier (verified)",
    ),
    "shared_fetch_bytes": ("tiered_kv_shared_fetch_bytes", "Bytes fetched from the shared tier"),
    "shared_publishes": ("tiered_kv_shared_publishes", "Entries published to the shared tier"),
    "shared_publish_bytes": (
        "tiered_kv_shared_publish_bytes",
        "Bytes published to the shared tier",
    ),
    "shared_publish_queue_bytes": (
        "tiered_kv_shared_publish_queue_bytes",
        "Bytes of entries waiting to be published",
    ),
    "shared_errors": (
        "tiered_kv_shared_errors",
        "Failed shared-tier calls (Redis down, slow, ...)",
    ),
    "shared_up": ("tiered_kv_shared_up", "1 when the last shared-tier call reached Redis"),
}


class _CacheCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the cache is closing
            log.exception("cache stats failed")
            return
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, doc = _NAMED.get(key, (f"tiered_kv_cache_{key}", f"cache stat {key}"))
            yield GaugeMetricFamily(name, doc, value=float(value))


class _BatchCollector(Collector):
    """The batch loop's gauges, read at scrape time from the worker's plain ints."""

    def __init__(self, worker: Any) -> None:
        self._w = worker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        w = self._w
        yield GaugeMetricFamily(
            "tiered_kv_batch_size", "Requests decoding together now", value=w.batch_size
        )
        yield GaugeMetricFamily(
            "tiered_kv_in_flight",
            "Requests in the batch loop (waiting to prefill, prefilling or decoding)",
            value=w.in_flight,
        )
        yield GaugeMetricFamily(
            "tiered_kv_queue_length", "Requests waiting for a place in the batch", value=w.pending()
        )


class Metrics:
    """The server's metrics; ``render()`` gives the /metrics body."""

    def __init__(
        self, cache_stats: Callable[[], dict[str, Any]] | None = None, worker: Any = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tiered_kv_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tiered_kv_prompt_tokens", "Prompt tokens received", registry=r
        )
        self.completion_tokens = Counter(
            "tiered_kv_completion_tokens", "Tokens generated", registry=r
        )
        self.cached_tokens = Counter(
            "tiered_kv_cached_tokens",
            "Prompt tokens served from the cache, by tier",
            ["tier"],
            registry=r,
        )
        for tier in ("hot", "cold", "shared"):
            self.cached_tokens.labels(tier=tier)  # exported at 0 before the first hit
        self.ttft = Histogram(
            "tiered_kv_ttft_seconds",
            "Time to first token (queue excluded)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_total = Histogram(
            "tiered_kv_request_ttft_seconds",
            "Time to first token of each request as its client sees it (queue included)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "tiered_kv_queue_wait_seconds",
            "Time a request waited before its prefill started (queue and batch admission)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        if cache_stats is not None:
            r.register(_CacheCollector(cache_stats))
        if worker is not None:
            r.register(_BatchCollector(worker))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation(self, usage: Any) -> None:
        """Record a finished generation's engine Usage (and log it: one line per request)."""
        ttft = usage.ttft_seconds
        log.info(
            "generation: prompt %d tokens, cached %d (tier %s), ttft %s, completion %d tokens",
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.cache_tier,
            "-" if ttft is None else f"{ttft:.3f}s",  # None: no first token (cancelled before)
            usage.completion_tokens,
        )
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        held = usage.held_tokens  # memory's, of a disk restore: the hot tier served them
        if usage.cached_tokens - held:
            self.cached_tokens.labels(tier=usage.cache_tier).inc(usage.cached_tokens - held)
        if held:
            self.cached_tokens.labels(tier="hot").inc(held)
        self.queue_wait.observe(usage.queue_seconds)
        if ttft is not None:
            self.ttft.observe(ttft)
            self.ttft_total.observe(usage.queue_seconds + ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
