"""Prometheus metrics of the server (one registry per server, so tests can run several)."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """Counters, histograms and gauges; `render()` gives the Prometheus text format."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "pallasite_http_requests", "HTTP requests by endpoint and status code "
            "(499: the client went away first).", ["endpoint", "status"], registry=r)
        self.finished = Counter(
            "pallasite_requests_finished", "Generation requests by how they ended (stop, length, "
            "abort, error).", ["reason"], registry=r)
        self.prompt_tokens = Counter("pallasite_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter("pallasite_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.preemptions = Counter("pallasite_preemptions", "Requests preempted for lack of KV "
                                   "pages.", registry=r)
        self.ttft = Histogram("pallasite_time_to_first_token_seconds", "From the request's arrival "
                              "to its first generated token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pallasite_time_per_output_token_seconds", "Time per generated token "
                              "after the first.", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pallasite_e2e_request_latency_seconds", "From the request's arrival "
                             "to its last token.", buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("pallasite_num_requests_running", "Sequences being generated.",
                             registry=r)
        self.waiting = Gauge("pallasite_num_requests_waiting", "Sequences waiting to start.",
                             registry=r)
        self.kv_pages_used = Gauge("pallasite_kv_cache_pages_used", "KV-cache pages in use.",
                                   registry=r)
        self.kv_pages_total = Gauge("pallasite_kv_cache_pages_total", "KV-cache pages in all.",
                                    registry=r)
        self.kv_usage = Gauge("pallasite_kv_cache_usage_ratio", "Share of KV-cache pages in use.",
                              registry=r)
        self.prefix_hit_rate = Gauge("pallasite_prefix_cache_hit_rate", "Share of prompt tokens "
                                     "found in the prefix cache.", registry=r)
        self.spec_acceptance = Gauge("pallasite_spec_decode_acceptance_rate", "Share of speculative "
                                     "tokens accepted (0 without speculative decoding).",
                                     registry=r)
        self.healthy = Gauge("pallasite_engine_healthy", "1 while the engine loop serves.",
                             registry=r)
        self.healthy.set(1)
        self._preemptions_seen = 0

    def update_engine(self, engine) -> None:
        """Copies the engine's gauges (called from the engine thread after each step)."""
        pool, scheduler = engine.pool, engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(scheduler.num_waiting)
        self.kv_pages_used.set(pool.num_used)
        self.kv_pages_total.set(pool.num_pages)
        self.kv_usage.set(pool.num_used / pool.num_pages)
        self.prefix_hit_rate.set(pool.prefix_hit_rate)
        spec = getattr(engine, "spec_stats", None)  # speculative decoding, where it exists
        drafted = getattr(spec, "num_draft_tokens", 0)
        self.spec_acceptance.set(spec.num_accepted_tokens / drafted if drafted else 0.0)
        new = scheduler.num_preemptions - self._preemptions_seen
        if new > 0:
            self.preemptions.inc(new)
            self._preemptions_seen = scheduler.num_preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)
