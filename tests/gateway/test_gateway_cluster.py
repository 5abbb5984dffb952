"""Three engines sharing a Redis KV tier behind one gateway: an ingest precomputes each chunk
on one engine only, and under load an engine killed with SIGKILL fails no request that had not
begun streaming, ends the streams it was serving with a clean error event, shows as down on
/ready and comes back into the rotation once restarted."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.gateway.gateway_testutil import (
    DOCUMENTS,
    QUERY,
    ask,
    metric_value,
    parse_sse,
    routed,
    wait_precomputed,
)
from tests.redis_server import redis_server

CLIENTS = 4
LOAD_BEFORE_KILL_S = 8.0
LOAD_AFTER_KILL_S = 12.0
MAX_TOKENS = 12
REMOTE_URL_ENV = "RAGBLEND_ENGINE_REMOTE_URL"
# A document of several 48-token chunks, so an ingest has chunks to spread over the pool.
LONG_DOCUMENT = " ".join(
    f"Station {i} of the Quendor railway sells {fruit} and maps of the Vantir pass."
    for i, fruit in enumerate(["pears", "figs", "plums", "dates", "limes", "melons"] * 3)
)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A redis-server of its own on a free loopback port, nothing persisted."""
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="module")
def cluster(spawn_engine, redis_url):
    """Three engines with room for the load (four sequences each, a queue of eight)."""
    return [
        spawn_engine("--queue-depth", "8", "--max-num-seqs", "4", env={REMOTE_URL_ENV: redis_url})
        for _ in range(3)
    ]


@pytest.fixture(scope="module")
def cluster_gateway(spawn_gateway, cluster, documents):
    # A quick health poll, so a dead or restarted engine is seen within a second.
    return spawn_gateway(*cluster, args=("--health-interval-s", "0.5"))


def precomputed_chunks(engine) -> float:
    """Chunks the engine's /v1/precompute was asked for (stored, skipped or failed)."""
    return metric_value(
        httpx.get(f"{engine.url}/metrics", timeout=10).text,
        "ragblend_engine_precomputed_chunks_total",
    )


def test_with_shared_kv_an_ingest_precomputes_each_chunk_on_exactly_one_engine(
    cluster, cluster_gateway
):
    reports = [httpx.get(f"{e.url}/health", timeout=10).json() for e in cluster]
    assert all(report["shared_kv"] is True for report in reports)
    before = [precomputed_chunks(e) for e in cluster]
    with httpx.Client(base_url=cluster_gateway.url, timeout=120) as http:
        created = http.post("/v1/documents", json={"text": LONG_DOCUMENT, "id": "railway"})
        assert created.status_code == 200, created.text
        try:
            chunk_ids = created.json()["chunk_ids"]
            assert len(chunk_ids) >= 3
            document = wait_precomputed(http, "railway")
        finally:  # the retriever is shared by every gateway test: leave its index as it was
            http.delete("/v1/documents/railway").raise_for_status()
    assert document["precompute"]["status"] == "ready", document["precompute"]
    asked = [precomputed_chunks(e) - b for e, b in zip(cluster, before, strict=True)]
    # Without a shared tier every engine would be asked for every chunk: 3 × as many.
    assert sum(asked) == len(chunk_ids), asked


@dataclass
class Outcomes:
    ok: int = 0
    broken: list[str] = field(default_factory=list)  # error details of streams that had begun
    failed: list[str] = field(default_factory=list)  # requests that failed before streaming
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            if kind == "ok":
                self.ok += 1
            else:
                getattr(self, kind).append(detail)


def stream_query(http: httpx.Client, doc_ids: list[str], max_tokens: int) -> tuple[str, str]:
    """("ok" | "broken" | "failed", detail) of one streamed query. A stream has begun once the
    gateway answered 200 (it does so only after the engine's first event)."""
    body = {**QUERY, "doc_ids": doc_ids, "max_tokens": max_tokens, "stream": True}
    try:
        with http.stream("POST", "/v1/query", json=body) as response:
            if response.status_code != 200:
                return "failed", f"HTTP {response.status_code}: {response.read()[:300]!r}"
            text = response.read().decode()
    except httpx.HTTPError as exc:
        return "failed", f"{type(exc).__name__}: {exc}"
    frames = parse_sse(text)  # well formed to the last byte
    last_event, last_data = frames[-1]
    if last_event == "result":
        return "ok", ""
    assert last_event == "error", f"a stream ended with {last_event!r}"
    assert not any(event == "result" for event, _ in frames)
    return "broken", json.loads(last_data)["detail"]


def run_load(url: str, until: float, outcomes: Outcomes, index: int) -> None:
    doc_sets = [list(c) for size in (1, 2) for c in itertools.combinations(DOCUMENTS, size)]
    with httpx.Client(base_url=url, timeout=120) as http:
        for doc_ids in itertools.islice(itertools.cycle(doc_sets), index, None):
            if time.monotonic() >= until:
                return
            outcomes.add(*stream_query(http, doc_ids, MAX_TOKENS))


def pool_state(http: httpx.Client, name: str) -> str:
    ready = http.get("/ready")
    assert ready.status_code == 200, ready.text
    return ready.json()["pool"][name]["state"]


def wait_state(http: httpx.Client, name: str, state: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pool_state(http, name) != state:
        assert time.monotonic() < deadline, f"{name} is not {state} after {timeout_s} s"
        time.sleep(0.2)


def test_an_engine_killed_under_load_fails_no_request_that_had_not_begun_streaming(
    cluster, cluster_gateway
):
    outcomes = Outcomes()
    with httpx.Client(base_url=cluster_gateway.url, timeout=120) as http:
        assert {pool_state(http, f"engine-{i}") for i in range(3)} == {"up"}
        index, victims_docs = routed(http)
        victim, name = cluster[index], f"engine-{index}"
        until = time.monotonic() + LOAD_BEFORE_KILL_S + LOAD_AFTER_KILL_S
        clients = [
            threading.Thread(target=run_load, args=(cluster_gateway.url, until, outcomes, i))
            for i in range(CLIENTS)
        ]
        long_stream: list[tuple[str, str]] = []
        # A long answer the victim is sure to be streaming when it dies.
        streaming = threading.Thread(
            target=lambda: long_stream.append(stream_query(http, victims_docs, 4000))
        )
        for thread in (*clients, streaming):
            thread.start()
        time.sleep(LOAD_BEFORE_KILL_S)
        victim.proc.kill()
        victim.proc.wait()
        wait_state(http, name, "down", timeout_s=5)
        for thread in (*clients, streaming):
            thread.join(timeout=120)
        assert not outcomes.failed, outcomes.failed
        assert outcomes.ok >= CLIENTS, outcomes
        ((kind, long_detail),) = long_stream
        assert kind == "broken", (kind, long_detail)
        for detail in [long_detail, *outcomes.broken]:
            assert detail.startswith(f"{name} failed") and "http://" not in detail, detail
        # Requests keep being answered, by the two engines left.
        answer = ask(http, victims_docs)
        assert answer.status_code == 200 and answer.json()["engine"] != name
        # Each broken stream is a 502 in the metrics and the access log, not the 200 it began as.
        metrics = http.get("/metrics").text
        broken = metric_value(
            metrics, "ragblend_gateway_requests_total", route="/v1/query", status="502"
        )
        assert broken == 1 + len(outcomes.broken)
        assert '"POST /v1/query" 502' in cluster_gateway.log()
        victim.start()
        wait_state(http, name, "up", timeout_s=10)
        assert ask(http, victims_docs).json()["engine"] == name
