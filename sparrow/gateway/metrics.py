"""The gateway's own Prometheus metrics, read from the router when scraped: per worker its
health, load, circuit-breaker state and the requests handed on from it to another worker.
(Requests, latencies, TTFT, tokens and media counts are the HTTP app's, as in `sparrow
serve`.)"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sparrow.gateway.router import Router

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class RouterCollector:
    """A prometheus_client collector over `router`'s workers."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        labels = ["worker"]
        healthy = GaugeMetricFamily(
            "sparrow_gateway_worker_healthy",
            "1 while the worker answers its health checks",
            labels=labels,
        )
        load = GaugeMetricFamily(
            "sparrow_gateway_worker_load",
            "requests at the worker (in flight here, or as it reports them while healthy)",
            labels=labels,
        )
        breaker = GaugeMetricFamily(
            "sparrow_gateway_worker_breaker_state",
            "circuit breaker: 0 closed, 1 half-open, 2 open",
            labels=labels,
        )
        retries = CounterMetricFamily(
            "sparrow_gateway_worker_retries",
            "requests handed on to another worker after failing here",
            labels=labels,
        )
        resumed = CounterMetricFamily(
            "sparrow_gateway_worker_resumed",
            "streams that went on at another worker after tokens had streamed here",
            labels=labels,
        )
        for w in self.router.workers:
            healthy.add_metric([w.address], float(w.alive))
            load.add_metric([w.address], float(w.load))
            breaker.add_metric([w.address], float(BREAKER_STATES[w.breaker.state]))
            retries.add_metric([w.address], float(w.retries))
            resumed.add_metric([w.address], float(w.resumed))
        yield from (healthy, load, breaker, retries, resumed)
