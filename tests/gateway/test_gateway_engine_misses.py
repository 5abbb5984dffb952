"""Engines that miss a request before its first event, as stand-in processes behind a real
gateway and retriever: a 429 spills to the next engine, a 5xx is a 502, a long prefill gets
its own time, an engine streaming other requests is not taken for a hung one, and a request
an engine took keeps its place past a short queue estimate while the engine streams others."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.routing import rank_engines
from tests.gateway import scripted_engine
from tests.gateway.gateway_testutil import metric_value
from tests.service_process import free_port

TTFT_TIMEOUT_S = 1.0
# What the stand-ins report: slow enough that a few hundred prompt bytes take seconds.
PREFILL_TOKENS_PER_S = 100.0
# Every chunk of the chosen documents is retrieved, so the chunk set (and the route) does not
# depend on the question.
TOP_K = 8
DOC_IDS = ["rivers"]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Iterator:
    """start(*args, port=None): a stand-in engine, stopped at the end of the module."""
    logs = tmp_path_factory.mktemp("scripted-engines")
    started: list[scripted_engine.ScriptedEngine] = []

    def start(*args: str, port: int | None = None) -> scripted_engine.ScriptedEngine:
        engine = scripted_engine.start(logs / f"engine-{len(started)}.log", *args, port=port)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def pair_ranked_for(documents: dict, start, first: tuple[str, ...], second: tuple[str, ...]):
    """Two stand-ins (args `first`, `second`) on ports chosen so that the rendezvous ranking of
    DOC_IDS' chunk set puts the first one first (rendezvous weights hash the URLs)."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    ranked = rank_engines(urls, [c for d in DOC_IDS for c in documents[d]])
    ports.sort(key=lambda port: ranked.index(f"http://127.0.0.1:{port}"))
    return start(*first, port=ports[0]), start(*second, port=ports[1])


def pool_gateway(spawn_gateway, *engines):
    # A slow health poll: within a test only the request path marks an engine down.
    return spawn_gateway(
        *engines,
        args=("--ttft-timeout-s", str(TTFT_TIMEOUT_S), "--health-interval-s", "60"),
    )


@pytest.fixture(scope="module")
def slow_pair(stand_ins, spawn_gateway, documents):
    """engine-0 honours "slow N" (and is DOC_IDS' rendezvous engine), engine-1 answers at
    once; both announce PREFILL_TOKENS_PER_S."""
    speed = ("--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S))
    pair = pair_ranked_for(documents, stand_ins, (*speed, "--slow-questions"), speed)
    return pool_gateway(spawn_gateway, *pair), pair


def ask(http: httpx.Client, question: str, doc_ids: list[str], **extra) -> httpx.Response:
    body = {"question": question, "doc_ids": doc_ids, "top_k": TOP_K, "max_tokens": 2, **extra}
    return http.post("/v1/query", json=body)


def own_prefill_s(answer: dict, question: str) -> float:
    """The prefill a stand-in announces for `question` over the answer's sources."""
    prompt_bytes = len(question.encode()) + sum(len(s["text"].encode()) for s in answer["sources"])
    return prompt_bytes / PREFILL_TOKENS_PER_S


def test_a_429_of_the_rendezvous_engine_spills_to_the_next_engine(
    stand_ins, spawn_gateway, documents
):
    pair = pair_ranked_for(documents, stand_ins, ("--generate-status", "429"), ())
    gateway = pool_gateway(spawn_gateway, *pair)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        answer = ask(http, "What is there?", DOC_IDS)
        assert answer.status_code == 200, answer.text
        assert answer.json()["engine"] == "engine-1"
        # Refusing costs the busy engine nothing: it stays in the rotation.
        assert http.get("/ready").json()["pool"]["engine-0"]["state"] == "up"


def test_only_when_every_engine_refuses_is_it_a_429_naming_them_all(
    stand_ins, spawn_gateway, documents
):
    gateway = pool_gateway(
        spawn_gateway, stand_ins("--generate-status", "429"), stand_ins("--generate-status", "429")
    )
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        refused = ask(http, "What is there?", DOC_IDS)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "2"
    detail = refused.json()["detail"]
    assert detail.startswith("engine busy") and "engine-0" in detail and "engine-1" in detail


def test_an_engine_5xx_is_a_502_naming_the_engine(stand_ins, spawn_gateway, documents):
    gateway = pool_gateway(spawn_gateway, stand_ins("--generate-status", "500"))
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        failed = ask(http, "What is there?", DOC_IDS)
        assert failed.status_code == 502
        detail = failed.json()["detail"]
        assert detail.startswith("engine failed") and "engine-0: HTTP 500" in detail
        assert "http://" not in detail
        metrics = http.get("/metrics").text
    errors = metric_value(metrics, "ragblend_gateway_upstream_errors_total", kind="failed")
    assert errors == 1


def test_a_prefill_longer_than_the_ttft_timeout_is_given_its_own_time(slow_pair):
    gateway, _ = slow_pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        probe = ask(http, "What is there?", DOC_IDS).json()
        assert probe["engine"] == "engine-0"
        # The first event comes after the TTFT timeout, within the time the prefill announces.
        estimate_s = own_prefill_s(probe, "slow 9.99 What is there?")
        assert estimate_s > 1.0, "too short a prompt for the test"
        question = f"slow {TTFT_TIMEOUT_S + estimate_s / 2:.2f} What is there?"
        answer = ask(http, question, DOC_IDS)
        assert answer.status_code == 200, answer.text
        assert answer.json()["engine"] == "engine-0"
        assert "failing over" not in gateway.log()


def test_an_engine_streaming_other_requests_is_not_marked_down_for_a_slow_first_event(
    slow_pair,
):
    gateway, (busy, _) = slow_pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        probe = ask(http, "What is there?", DOC_IDS).json()
        # Later than even the deadline that counts the request's own prefill.
        late_s = TTFT_TIMEOUT_S + own_prefill_s(probe, "slow 99.99 What is there?") + 1.5
        long_stream = {"question": "Tell me", "doc_ids": DOC_IDS, "top_k": TOP_K}
        with http.stream(
            "POST", "/v1/query", json={**long_stream, "max_tokens": 200, "stream": True}
        ) as streaming:
            assert streaming.headers["X-RAGBlend-Engine"] == "engine-0"
            lines = streaming.iter_lines()
            assert next(line for line in lines if line == "event: delta")
            answer = ask(http, f"slow {late_s:.2f} What is there?", DOC_IDS)
            assert answer.status_code == 200, answer.text
            assert answer.json()["engine"] == "engine-1"  # the idle engine took it
        # Still in the rotation (the health poll is a minute away): the next one goes there.
        assert ask(http, "What is there?", DOC_IDS).json()["engine"] == "engine-0"
    assert f"engine-0 ({busy.url}) is down" not in gateway.log()


def test_a_taken_request_keeps_its_place_past_a_short_estimate_while_its_engine_streams_others(
    slow_pair,
):
    gateway, _ = slow_pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        probe = ask(http, "What is there?", DOC_IDS).json()
        # Past the deadline of the announced wait (0) and the request's own prefill.
        late_s = TTFT_TIMEOUT_S + own_prefill_s(probe, "queued 99.99 What is there?") + 1.5
        failovers = gateway.log().count("failing over")
        long_stream = {"question": "Tell me", "doc_ids": DOC_IDS, "top_k": TOP_K}
        with http.stream(
            "POST", "/v1/query", json={**long_stream, "max_tokens": 200, "stream": True}
        ) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line == "event: delta")
            answer = ask(http, f"queued {late_s:.2f} What is there?", DOC_IDS)
            assert answer.status_code == 200, answer.text
            assert answer.json()["engine"] == "engine-0"  # it waited on the engine that took it
    assert gateway.log().count("failing over") == failovers


def test_a_taken_request_whose_engine_falls_silent_fails_over_after_the_announced_wait(
    slow_pair,
):
    gateway, (busy, _) = slow_pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        probe = ask(http, "What is there?", DOC_IDS).json()
        deadline_s = TTFT_TIMEOUT_S + own_prefill_s(probe, "queued 99.99 What is there?")
        answer = ask(http, f"queued {deadline_s + 30:.2f} What is there?", DOC_IDS)
        assert answer.status_code == 200, answer.text
        assert answer.json()["engine"] == "engine-1"
        assert answer.elapsed.total_seconds() < deadline_s + 10
        assert f"engine-0 ({busy.url}) is down" in gateway.log()
        # Back in the rotation once a health probe (here /ready's) sees it answer.
        assert http.get("/ready").status_code == 200
        assert ask(http, "What is there?", DOC_IDS).json()["engine"] == "engine-0"
