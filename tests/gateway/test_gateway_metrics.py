"""GET /metrics: Prometheus text that prometheus_client parses, and counters that move."""

from __future__ import annotations

from tests.gateway.gateway_testutil import metric_value


def test_metrics_parse_and_count_the_query_traffic(client):
    before = client.get("/metrics").text
    response = client.post("/v1/query", json={"question": "Kessa pass?", "mode": "full_reuse"})
    assert response.status_code == 200, response.text
    after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text

    def moved(name: str, **labels: str) -> float:
        return metric_value(text, name, **labels) - metric_value(before, name, **labels)

    assert moved("ragblend_gateway_requests_total", route="/v1/query", status="200") == 1
    assert moved("ragblend_gateway_request_duration_seconds_count", route="/v1/query") == 1
    assert moved("ragblend_gateway_ttft_seconds_count", mode="full_reuse") == 1
    assert moved("ragblend_gateway_retrieval_duration_seconds_count") == 1
    assert moved("ragblend_gateway_engine_duration_seconds_count", mode="full_reuse") == 1
    usage = response.json()["usage"]
    for kind in ("prompt", "completion", "cached"):
        assert (
            moved("ragblend_gateway_tokens_total", kind=kind, mode="full_reuse")
            == usage[f"{kind}_tokens"]
        )
    assert metric_value(text, "ragblend_gateway_in_flight_requests") == 0


def test_metrics_count_bad_requests_by_status(client):
    before = client.get("/metrics").text
    client.post("/v1/query", json={"top_k": 1})
    after = client.get("/metrics").text
    assert (
        metric_value(after, "ragblend_gateway_requests_total", route="/v1/query", status="422")
        - metric_value(before, "ragblend_gateway_requests_total", route="/v1/query", status="422")
    ) == 1
