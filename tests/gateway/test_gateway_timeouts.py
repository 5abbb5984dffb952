"""Hung dependencies (real processes frozen with SIGSTOP): bounded waits on the retriever,
/ready within 2 s, and a frozen engine left for the next one before its first event."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.gateway.gateway_testutil import QUERY, ask, frozen, routed, timed

TTFT_TIMEOUT_S = 2.0
RETRIEVAL_TIMEOUT_S = 2.0
# Scheduling and the tiny model's own generation on a loaded CPU.
SLACK_S = 3.0


@pytest.fixture(scope="module")
def spare_engine(spawn_engine):
    """The second engine of the pair; the tests freeze whichever engine their query is routed to,
    and resume it before they end."""
    return spawn_engine()


@pytest.fixture(scope="module")
def lone_retriever(spawn_retriever):
    """A retriever these tests freeze."""
    return spawn_retriever()


@pytest.fixture(scope="module")
def pair_gateway(spawn_gateway, engine, spare_engine, documents):
    """Two engines; the health poller slow enough that only the TTFT deadline notices a
    frozen engine within a test."""
    return spawn_gateway(
        engine,
        spare_engine,
        args=(
            "--ttft-timeout-s",
            str(TTFT_TIMEOUT_S),
            "--health-interval-s",
            "60",
            "--generate-timeout-s",
            "3",
        ),
    )


def own_prefill_s(http: httpx.Client, index: int, doc_ids: list[str]) -> float:
    """What the gateway adds to the TTFT timeout for the query's own prefill on engine
    `index`: the prompt's bytes at the speed the engine reported (/ready refreshes it)."""
    sources = ask(http, doc_ids).json()["sources"]
    prompt_bytes = len(QUERY["question"].encode()) + sum(len(s["text"].encode()) for s in sources)
    speed = http.get("/ready").json()["pool"][f"engine-{index}"]["prefill_tokens_per_s"]
    return prompt_bytes / speed if speed else 0.0


def test_a_frozen_engine_is_left_for_the_next_one_within_the_ttft_timeout(
    pair_gateway, engine, spare_engine
):
    with httpx.Client(base_url=pair_gateway.url, timeout=60) as http:
        index, doc_ids = routed(http)
        # Frozen and resumed in this test only, so the session's engine may be the one.
        victim, other = [engine, spare_engine][index], f"engine-{1 - index}"
        deadline_s = TTFT_TIMEOUT_S + own_prefill_s(http, index, doc_ids)
        with frozen(victim):
            answer, elapsed_s = timed(lambda: ask(http, doc_ids))
            assert answer.status_code == 200, answer.text
            assert answer.json()["engine"] == other
            assert elapsed_s < deadline_s + SLACK_S
            failovers = pair_gateway.log().count("failing over")
            assert failovers >= 1
            # Out of the rotation now: the next query does not wait for it again.
            again = ask(http, doc_ids)
            assert again.json()["engine"] == other
            assert pair_gateway.log().count("failing over") == failovers
        # Back in the rotation once a health probe (here /ready's) sees it answer.
        deadline = time.monotonic() + 30
        while http.get("/ready").json().get("engines_up") != 2:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.2)
        assert ask(http, doc_ids).json()["engine"] == f"engine-{index}"


def test_an_engine_that_stalls_mid_stream_ends_it_with_an_sse_error_event(
    pair_gateway, engine, spare_engine
):
    with httpx.Client(base_url=pair_gateway.url, timeout=60) as http:
        index, doc_ids = routed(http)
        victim, name = [engine, spare_engine][index], f"engine-{index}"
        with http.stream(
            "POST",
            "/v1/query",
            json={**QUERY, "doc_ids": doc_ids, "max_tokens": 4000, "stream": True},
        ) as response:
            assert response.headers["X-RAGBlend-Engine"] == name
            lines = response.iter_lines()
            assert next(line for line in lines if line == "event: delta")
            with frozen(victim):
                rest = list(lines)
    error_at = rest.index("event: error")
    assert rest[error_at + 1].startswith("data: ") and "event: result" not in rest
    detail = json.loads(rest[error_at + 1][6:])["detail"]
    assert detail.startswith(f"{name} failed") and "http://" not in detail


def test_a_frozen_retriever_is_a_504_within_the_retrieval_timeout(
    spawn_gateway, engine, lone_retriever
):
    gateway = spawn_gateway(
        engine,
        args=(
            "--retriever-url",
            lone_retriever.url,
            "--retrieval-timeout-s",
            str(RETRIEVAL_TIMEOUT_S),
        ),
    )
    with httpx.Client(base_url=gateway.url, timeout=60) as http, frozen(lone_retriever):
        answer, elapsed_s = timed(lambda: http.post("/v1/query", json={"question": "Kessa?"}))
        assert answer.status_code == 504
        assert answer.json()["detail"].startswith("retriever timed out")
        assert elapsed_s < RETRIEVAL_TIMEOUT_S + 1.5
        listed, elapsed_s = timed(lambda: http.get("/v1/documents"))
        assert listed.status_code == 504 and elapsed_s < RETRIEVAL_TIMEOUT_S + 1.5
    # A timed-out read is not retried: the retriever saw each search once.
    assert gateway.log().count("retrying") == 0


def test_ready_answers_within_2_s_whatever_the_dependencies_do(
    spawn_gateway, spare_engine, lone_retriever
):
    gateway = spawn_gateway(spare_engine, args=("--retriever-url", lone_retriever.url))
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        assert http.get("/ready").status_code == 200
        with frozen(spare_engine):
            ready, elapsed_s = timed(lambda: http.get("/ready"))
            assert ready.status_code == 503 and elapsed_s < 2
            assert ready.json()["detail"].startswith("engine not ready")
            with frozen(lone_retriever):
                ready, elapsed_s = timed(lambda: http.get("/ready"))
                assert ready.status_code == 503 and elapsed_s < 2
                assert ready.json()["detail"].startswith("retriever not ready")
                health, elapsed_s = timed(lambda: http.get("/health"))
                assert health.status_code == 200 and elapsed_s < 1
        assert http.get("/ready").status_code == 200
