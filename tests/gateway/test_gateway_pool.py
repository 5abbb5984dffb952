"""The engine pool: rendezvous routing by chunk set, failover, 503 naming the engine while
it is down and recovery without a gateway restart."""

from __future__ import annotations

import httpx
import pytest

from gateway.routing import rank_engines
from tests.service_process import free_port


@pytest.fixture(scope="module")
def second_engine(spawn_engine):
    return spawn_engine()


@pytest.fixture(scope="module")
def pool_gateway(spawn_gateway, engine, second_engine, documents):
    return spawn_gateway(engine, second_engine)


def ask(http: httpx.Client, doc_id: str) -> httpx.Response:
    return http.post(
        "/v1/query",
        json={"question": "What is there?", "doc_ids": [doc_id], "top_k": 2, "max_tokens": 2},
    )


def name_of(urls: list[str], url: str) -> str:
    """Clients see an engine by its index in engine_urls."""
    return f"engine-{urls.index(url)}"


def test_the_same_chunk_set_always_goes_to_its_rendezvous_engine(
    pool_gateway, engine, second_engine
):
    urls = [engine.url, second_engine.url]
    with httpx.Client(base_url=pool_gateway.url, timeout=120) as http:
        for doc_id in ("rivers", "mountains", "orchards"):
            answers = [ask(http, doc_id).json() for _ in range(2)]
            chunk_ids = [s["chunk_id"] for s in answers[0]["sources"]]
            expected = name_of(urls, rank_engines(urls, chunk_ids)[0])
            assert [a["engine"] for a in answers] == [expected, expected]


def test_requests_fail_over_when_their_engine_is_down_and_return_when_it_is_back(
    pool_gateway, engine, second_engine, spawn_gateway
):
    urls = [engine.url, second_engine.url]
    with httpx.Client(base_url=pool_gateway.url, timeout=120) as pool:
        chunk_ids = [s["chunk_id"] for s in ask(pool, "rivers").json()["sources"]]
        preferred, other = (
            (engine, second_engine)
            if rank_engines(urls, chunk_ids)[0] == engine.url
            else (second_engine, engine)
        )
        alone = httpx.Client(base_url=spawn_gateway(preferred).url, timeout=120)
        preferred.stop()
        try:
            failed_over = ask(pool, "rivers")
            assert failed_over.status_code == 200, failed_over.text
            assert failed_over.json()["engine"] == name_of(urls, other.url)
            down = ask(alone, "rivers")
            assert down.status_code == 503
            detail = down.json()["detail"]
            assert detail.startswith("engine unavailable") and "engine-0" in detail
            assert "http://" not in detail  # clients never see internal addresses
            ready = alone.get("/ready")
            assert ready.status_code == 503 and "engine" in ready.json()["detail"]
        finally:
            preferred.start()
        # Neither gateway was restarted: both use the engine again as soon as it answers
        # (/ready probes the engines now, which also puts the engine back in the rotation).
        assert ask(alone, "rivers").status_code == 200
        assert alone.get("/ready").status_code == 200
        assert pool.get("/ready").json()["engines_up"] == 2
        assert ask(pool, "rivers").json()["engine"] == name_of(urls, preferred.url)
        alone.close()


def test_retriever_down_is_a_503_naming_it(spawn_gateway, engine):
    nowhere = f"http://127.0.0.1:{free_port()}"
    orphan = spawn_gateway(engine, args=("--retriever-url", nowhere))
    with httpx.Client(base_url=orphan.url, timeout=60) as http:
        response = http.post("/v1/query", json={"question": "Kessa pass?"})
        assert response.status_code == 503
        assert response.json()["detail"].startswith("retriever unavailable")
        ready = http.get("/ready")
        assert ready.status_code == 503 and "retriever" in ready.json()["detail"]
