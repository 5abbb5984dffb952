"""Saturation and cancellation: 429 with Retry-After at the gateway's concurrency limit and
at a full engine queue; a client that leaves frees the engine's worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.gateway_testutil import metric_value

# Thousands of tokens take the tiny model many seconds: only a cancellation ends them sooner.
LONG = {"question": "Tell me everything about Quendor.", "max_tokens": 4000, "top_k": 2}


def engine_busy(engine) -> tuple[float, float]:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return (
        metric_value(text, "ragblend_engine_requests_running"),
        metric_value(text, "ragblend_engine_requests_waiting"),
    )


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def first_delta(response: httpx.Response) -> Iterator[str]:
    """The stream's lines after its first delta. Keep a reference: dropping a half-read
    iterator makes httpx close the connection, which is a disconnect."""
    lines = response.iter_lines()
    for line in lines:
        if line == "event: delta":
            return lines
    raise AssertionError("the stream ended before its first delta")


@pytest.fixture(scope="module")
def narrow_gateway(spawn_gateway, engine, documents):
    """A gateway that admits one query at a time."""
    return spawn_gateway(engine, args=("--max-concurrency", "1", "--retry-after-s", "3"))


def test_gateway_at_its_concurrency_limit_answers_429_with_retry_after(narrow_gateway, engine):
    with httpx.Client(base_url=narrow_gateway.url, timeout=120) as http:
        with http.stream("POST", "/v1/query", json={**LONG, "stream": True}) as running:
            lines = first_delta(running)
            refused = http.post("/v1/query", json={"question": "Kessa pass?"})
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "3"
            assert "max_concurrency" in refused.json()["detail"]
            chat = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            assert chat.status_code == 429
            assert next(lines)  # still streaming
            text = http.get("/metrics").text
            assert metric_value(text, "ragblend_gateway_rejected_requests_total") == 2
            assert (
                metric_value(
                    text, "ragblend_gateway_requests_total", route="/v1/query", status="429"
                )
                == 1
            )
            assert metric_value(text, "ragblend_gateway_in_flight_requests") == 1
        wait_until(lambda: engine_busy(engine) == (0, 0), 15, "the engine to go idle")
        assert http.post("/v1/query", json={"question": "Kessa pass?"}).status_code == 200


def test_client_leaving_a_stream_cancels_the_engines_generation(narrow_gateway, engine):
    with httpx.Client(base_url=narrow_gateway.url, timeout=120) as http:
        with http.stream("POST", "/v1/query", json={**LONG, "stream": True}) as response:
            lines = first_delta(response)
            assert engine_busy(engine)[0] == 1
            assert next(lines)
        wait_until(lambda: engine_busy(engine) == (0, 0), 4, "the engine to go idle")
        text = http.get("/metrics").text
        assert metric_value(text, "ragblend_gateway_in_flight_requests") == 0


def test_client_leaving_a_non_streamed_query_cancels_the_engines_generation(narrow_gateway, engine):
    timeout = httpx.Timeout(120, read=2)
    with (
        httpx.Client(base_url=narrow_gateway.url, timeout=timeout) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/query", json=LONG)
    wait_until(lambda: engine_busy(engine) == (0, 0), 4, "the engine to go idle")


def test_full_engine_queue_is_a_429_naming_the_engine(gateway, engine, documents):
    with (
        httpx.Client(base_url=gateway.url, timeout=120) as http,
        ThreadPoolExecutor(1) as background,
    ):
        with http.stream("POST", "/v1/query", json={**LONG, "stream": True}) as running:
            lines = first_delta(running)
            # The gateway answers once the engine's first event arrives: this one waits.
            queued = background.submit(http.post, "/v1/query", json={**LONG, "max_tokens": 2})
            wait_until(lambda: engine_busy(engine)[1] == 1, 15, "a generation to wait")
            refused = http.post("/v1/query", json={"question": "Kessa pass?"})
            assert refused.status_code == 429
            assert refused.json()["detail"].startswith("engine busy")
            assert "Retry-After" in refused.headers
            assert next(lines)
        assert queued.result().status_code == 200
        wait_until(lambda: engine_busy(engine) == (0, 0), 15, "the engine to go idle")
