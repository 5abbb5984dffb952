"""A burst queues requests behind each other faster than the gateway's health poll sees: the
engine announces each request's queue wait as it queues it (a response header), and the
gateway waits that long for the first event instead of giving the request up with a 504."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest

from common.contract import QUEUE_ESTIMATE_HEADER

TTFT_TIMEOUT_S = 2.0
# The work queued ahead of the query, in multiples of the TTFT timeout: far past the deadline
# that the polled estimate (0: the engine was idle at the gateway's only probe) allows.
AHEAD_FACTOR = 3.0
AHEAD_REQUESTS = 4
QUESTION = "What is there?"


@pytest.fixture(scope="module")
def busy_engine(spawn_engine):
    """One sequence at a time, room for the requests queued ahead."""
    return spawn_engine("--queue-depth", str(AHEAD_REQUESTS + 2))


@pytest.fixture(scope="module")
def slow_poll_gateway(spawn_gateway, busy_engine, documents):
    """The health poller probes once, at start: its queue estimate stays that of an idle
    engine, as a burst within one poll period sees it."""
    return spawn_gateway(
        busy_engine,
        args=("--ttft-timeout-s", str(TTFT_TIMEOUT_S), "--health-interval-s", "600"),
    )


def generate(engine_url: str, max_tokens: int) -> dict:
    return {"question": QUESTION, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def stream_through(
    engine_url: str, max_tokens: int, announced: list[float], done: threading.Event
) -> None:
    """One generation streamed to its end; the wait its engine announced goes to `announced`."""
    with httpx.Client(timeout=300) as http:
        body = generate(engine_url, max_tokens)
        with http.stream("POST", f"{engine_url}/v1/generate", json=body) as response:
            assert response.status_code == 200, response.read()
            announced.append(float(response.headers[QUEUE_ESTIMATE_HEADER]))
            for _ in response.iter_bytes():
                pass
    done.set()


def seconds_per_token(engine_url: str) -> float:
    """The engine's decode time per token alone (it also measures the engine's step speeds,
    which its queue estimate needs)."""
    with httpx.Client(timeout=300) as http:
        start = time.perf_counter()
        body = {**generate(engine_url, 64), "stream": False}
        assert http.post(f"{engine_url}/v1/generate", json=body).status_code == 200
        return (time.perf_counter() - start) / 64


def wait_queued(engine_url: str, waiting: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{engine_url}/health", timeout=10).json()
        if health["requests_running"] == 1 and health["requests_waiting"] >= waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"{waiting} requests never waited on {engine_url}")


def test_a_query_queued_behind_a_burst_waits_for_the_wait_its_engine_announced(
    slow_poll_gateway, busy_engine
):
    per_token_s = seconds_per_token(busy_engine.url)
    # The requests ahead decode this many tokens each (within the tiny model's context).
    max_tokens = min(900, math.ceil(AHEAD_FACTOR * TTFT_TIMEOUT_S / AHEAD_REQUESTS / per_token_s))
    announced: list[float] = []
    done = [threading.Event() for _ in range(AHEAD_REQUESTS)]
    threads = [
        threading.Thread(
            target=stream_through, args=(busy_engine.url, max_tokens, announced, event), daemon=True
        )
        for event in done
    ]
    for thread in threads:
        thread.start()
    wait_queued(busy_engine.url, AHEAD_REQUESTS - 1)
    with httpx.Client(base_url=slow_poll_gateway.url, timeout=300) as http:
        start = time.perf_counter()
        answer = http.post("/v1/query", json={"question": QUESTION, "top_k": 2, "max_tokens": 2})
        elapsed_s = time.perf_counter() - start
    assert answer.status_code == 200, answer.text
    # It did wait past the TTFT timeout, behind the burst.
    assert elapsed_s > TTFT_TIMEOUT_S
    assert "failing over" not in slow_poll_gateway.log()
    for thread in threads:
        thread.join(timeout=300)
    assert all(event.is_set() for event in done)
    # Every streamed generation announced its wait; the last queued waited behind the rest.
    assert len(announced) == AHEAD_REQUESTS and min(announced) >= 0.0
    assert max(announced) >= (AHEAD_REQUESTS - 2) * max_tokens * per_token_s * 0.5
