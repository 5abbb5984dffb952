"""Prometheus metrics of the gateway's request path, all named `ragblend_gateway_*` and listed
with one line each in docs/gateway.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.contract import Usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_KINDS = ("prompt", "completion", "cached", "recomputed")


class GatewayMetrics:
    """One registry per app, so that several apps in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "ragblend_gateway_requests",
            "HTTP requests finished, by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "ragblend_gateway_request_duration_seconds",
            "HTTP request latency until the last byte, by route, method and status",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "ragblend_gateway_in_flight_requests",
            "Query requests being served (all routes "
            "that generate), the quantity bounded by max_concurrency",
            registry=r,
        )
        self.rejected = Counter(
            "ragblend_gateway_rejected_requests",
            "Query requests refused with 429 because max_concurrency were in flight",
            registry=r,
        )
        self.ttft = Histogram(
            "ragblend_gateway_ttft_seconds",
            "Time from the request's arrival to its first answer token, by mode",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retrieval_seconds = Histogram(
            "ragblend_gateway_retrieval_duration_seconds",
            "Retriever search latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "ragblend_gateway_engine_duration_seconds",
            "Engine generation latency (request sent to result received), by mode",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_requests = Counter(
            "ragblend_gateway_engine_requests",
            "Generations sent to each engine of the pool",
            ["engine"],
            registry=r,
        )
        self.tokens = Counter(
            "ragblend_gateway_tokens",
            "Tokens of finished generations, by kind (prompt, "
            "completion, cached = reused chunk KV, recomputed)",
            ["kind", "mode"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "ragblend_gateway_upstream_errors",
            "Failed calls to a dependency, by dependency "
            "and kind (unavailable, timeout, busy, rejected, failed)",
            ["dependency", "kind"],
            registry=r,
        )
        for dependency in ("retriever", "engine"):  # zero series, so dashboards show 0 errors
            for kind in ("unavailable", "timeout", "busy", "rejected", "failed"):
                self.upstream_errors.labels(dependency, kind)
        self.documents = Counter(
            "ragblend_gateway_documents",
            "Documents ingested, by final precompute status",
            ["status"],
            registry=r,
        )

    def upstream_error(self, dependency: str, kind: str) -> None:
        self.upstream_errors.labels(dependency, kind).inc()

    def observe_generation(self, mode: str, usage: Usage, engine_s: float) -> None:
        self.engine_seconds.labels(mode).observe(engine_s)
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind, mode).inc(getattr(usage, f"{kind}_tokens"))
