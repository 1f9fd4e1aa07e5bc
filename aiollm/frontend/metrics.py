"""Prometheus metrics of the HTTP frontend: latency histograms, load gauges, token throughput.

Each frontend owns its own `CollectorRegistry` (not the process-global one), so several frontends
in one test process do not collide. Latencies are measured where the client sees them: TTFT from
request arrival to the first token delta, TPOT as the mean gap between later tokens of a request
(DistServe's definition). Load gauges are refreshed from the backend on every scrape.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aiollm.serving.backend import BackendStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# Window over which tokens/s is averaged, in seconds.
_RATE_WINDOW_S = 10.0

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    """The frontend's metric families and the bookkeeping that feeds them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "aiollm_time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "aiollm_time_per_output_token_seconds",
            "Mean gap between tokens after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "aiollm_e2e_request_latency_seconds", "Arrival to last token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.requests = Counter("aiollm_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("aiollm_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.generation_tokens = Counter("aiollm_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge(
            "aiollm_generation_tokens_per_second", f"Generated tokens/s over the last {_RATE_WINDOW_S:g} s", registry=r
        )
        self.running = Gauge("aiollm_num_requests_running", "Requests producing tokens", registry=r)
        self.waiting = Gauge("aiollm_num_requests_waiting", "Requests accepted, no token yet", registry=r)
        self.prefill_queue = Gauge(
            "aiollm_prefill_queue_length", "Queue length per prefill instance", ["instance"], registry=r
        )
        self.decode_queue = Gauge(
            "aiollm_decode_queue_length", "Admission queue per decode instance", ["instance"], registry=r
        )
        self.kv_used = Gauge("aiollm_kv_blocks_used", "KV blocks in use, all instances", registry=r)
        self.kv_total = Gauge("aiollm_kv_blocks_total", "KV blocks in total, all instances", registry=r)
        self.in_flight = Gauge("aiollm_frontend_requests_in_flight", "HTTP requests being served", registry=r)
        self.resumed = Gauge(
            "aiollm_requests_resumed",
            "Requests resumed after a lost process, by how: KV pulled again (repull), prefilled again (reprefill), "
            "submitted again to a restarted controller (resubmitted)",
            ["how"],
            registry=r,
        )
        self.instances = Gauge("aiollm_instances", "Live instances by kind (prefill, decode)", ["kind"], registry=r)
        self.replans = Gauge("aiollm_replans", "Placement changes enacted while serving", registry=r)
        self.last_replan = Gauge(
            "aiollm_last_replan_info",
            "The last placement change: why, and the counts before and after",
            ["replan"],
            registry=r,
        )
        self.backend_up = Gauge("aiollm_backend_up", "1 while the frontend reaches its backend, else 0", registry=r)
        self.instance_up = Gauge(
            "aiollm_instance_up", "1 while the controller counts the instance alive, else 0", ["instance"], registry=r
        )
        self.instance_kv = Gauge(
            "aiollm_instance_kv_blocks_used", "KV blocks held per instance", ["instance"], registry=r
        )
        self.prompt_tokens = Gauge("aiollm_prefill_prompt_tokens", "Prompt tokens prefilled, all instances", registry=r)
        self.prefix_hits = Gauge(
            "aiollm_prefix_cache_hit_tokens",
            "Prompt tokens whose KV a prefill instance mapped from its prefix cache instead of computing it",
            registry=r,
        )
        self.kv_pulled = Gauge(
            "aiollm_kv_blocks_pulled", "Prompt KV blocks decode instances pulled from prefill instances", registry=r
        )
        self.kv_reused = Gauge(
            "aiollm_kv_blocks_reused",
            "Prompt KV blocks decode instances mapped from their own prefix cache instead of pulling them",
            registry=r,
        )
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent deltas

    def tokens_generated(self, count: int) -> None:
        now = time.monotonic()
        self.generation_tokens.inc(count)
        self._recent.append((now, count))

    def request_done(
        self, outcome: str, arrival: float, first: float | None, last: float | None, n_tokens: int
    ) -> None:
        """Record one finished request (times from `time.monotonic()`)."""
        self.requests.labels(outcome=outcome).inc()
        if first is not None:
            self.ttft.observe(first - arrival)
        if last is not None:
            self.e2e.observe(last - arrival)
            if first is not None and n_tokens > 1:
                self.tpot.observe((last - first) / (n_tokens - 1))

    def render(self, stats: BackendStats | None) -> bytes:
        """Refresh the load gauges from `stats` and return the exposition text; None: the backend is
        unreachable (its gauges read as down, the frontend's own figures still count)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            self._recent.popleft()
        self.tokens_per_second.set(sum(n for _, n in self._recent) / _RATE_WINDOW_S)
        self.backend_up.set(0 if stats is None else 1)
        if stats is None:
            self.instance_up.clear()
            return generate_latest(self.registry)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.prompt_tokens.set(stats.prompt_tokens)
        self.prefix_hits.set(stats.prefix_hit_tokens)
        self.kv_pulled.set(stats.kv_blocks_pulled)
        self.kv_reused.set(stats.kv_blocks_reused)
        per_instance = (
            (self.prefill_queue, stats.prefill_queues),
            (self.decode_queue, stats.decode_queues),
            (self.instance_up, {n: int(up) for n, up in stats.alive.items()}),
            (self.instance_kv, stats.instance_kv_blocks_used),
        )
        self.resumed.clear()
        for how, count in stats.resumed.items():
            self.resumed.labels(how=how).set(count)
        self.instances.clear()
        if stats.alive:
            for kind, names in (("prefill", stats.prefill_queues), ("decode", stats.decode_queues)):
                self.instances.labels(kind=kind).set(sum(bool(stats.alive.get(n)) for n in names))
        self.replans.set(stats.replans)
        self.last_replan.clear()
        if stats.last_replan:
            self.last_replan.labels(replan=stats.last_replan).set(1)
        for gauge, values in per_instance:
            gauge.clear()
            for name, value in values.items():
                gauge.labels(instance=name).set(value)
        return generate_latest(self.registry)
