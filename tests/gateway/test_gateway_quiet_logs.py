"""Quiet consoles: the probes of /health, /ready and /metrics leave no INFO line in the log
of any service (gateway, retriever, engine), while a real request does and probes still count."""

from __future__ import annotations

import httpx

from tests.gateway.gateway_testutil import QUERY, metric_value

PROBES = ("/health", "/metrics")


def test_probes_are_not_logged_at_info_but_a_query_is_in_every_service(
    gateway, retriever, engine, documents
):
    for service in (gateway, retriever, engine):
        for path in (*PROBES, *PROBES, *PROBES):
            assert httpx.get(f"{service.url}{path}", timeout=30).status_code == 200
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        assert http.get("/ready").status_code == 200  # also probes the retriever and engine
        assert http.post("/v1/query", json={**QUERY, "doc_ids": ["rivers"]}).status_code == 200
        metrics = http.get("/metrics").text
    for service, request in (
        (gateway, '"POST /v1/query" 200'),
        (retriever, "search top_k="),  # its own line per search (no access log)
        (engine, '"POST /v1/generate HTTP/1.1" 200'),
    ):
        log = service.log()
        assert request in log, f"{service.name} logs its real requests"
        for path in (*PROBES, "/ready"):
            assert f"GET {path}" not in log, f"{service.name} logged a probe of {path}"
    counted = metric_value(metrics, "ragblend_gateway_requests_total", route="/health")
    assert counted >= 3
