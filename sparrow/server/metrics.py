"""Prometheus metrics of the server: requests, tokens, aborts, latencies, and the engine's
queue depth, running requests and KV-cache usage (read from `EngineClient.stats` when
scraped)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sparrow.engine.client import EngineClient


class Metrics:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "sparrow_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("sparrow_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "sparrow_generation_tokens", "generated tokens", registry=r
        )
        self.aborted = Counter("sparrow_aborted_requests", "requests aborted", registry=r)
        self.media_items = Counter(
            "sparrow_media_items", "images and videos in prompts", registry=r
        )
        self.media_seconds = Histogram(
            "sparrow_media_preprocess_seconds",
            "fetch, decode and preprocess of a request's media",
            registry=r,
        )
        self.media_bytes = Counter("sparrow_media_bytes", "encoded media bytes fetched", registry=r)
        self.ttft = Histogram(
            "sparrow_time_to_first_token_seconds", "time to first token", registry=r
        )
        self.itl = Histogram(
            "sparrow_inter_token_latency_seconds", "inter-token latency", registry=r
        )
        self.waiting = Gauge("sparrow_queue_depth", "requests waiting", registry=r)
        self.running = Gauge("sparrow_running_requests", "requests running", registry=r)
        self.kv_usage = Gauge("sparrow_kv_cache_usage", "fraction of KV blocks in use", registry=r)
        self.prefix_hit_rate = Gauge(
            "sparrow_prefix_cache_hit_rate",
            "prompt tokens found in the prefix cache / admitted",
            registry=r,
        )
        self.state_snapshots = Gauge(
            "sparrow_prefix_cache_state_snapshots",
            "recurrent-state snapshots filed for prefix hits",
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text format, engine gauges updated now."""
        stats = self.engine.stats()
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        self.state_snapshots.set(stats.state_snapshots)
        return generate_latest(self.registry)
