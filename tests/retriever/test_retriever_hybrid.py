"""Hybrid retrieval and the second hop against the real process: POST /v1/search with
`retrieval` (dense, bm25, hybrid) and `hops`, their scores, validation and hostile queries."""

from __future__ import annotations

import uuid

import pytest

FERRIES = 20


def _collection() -> str:
    return f"hy-{uuid.uuid4().hex[:10]}"


def _ingest(client, collection: str, *texts: str) -> list[str]:
    ids = []
    for text in texts:
        response = client.post(
            "/v1/documents", params={"collection": collection}, json={"text": text}
        )
        assert response.status_code == 200, response.text
        ids.append(response.json()["doc_id"])
    return ids


def _search(client, collection: str, query: str, **body) -> list[dict]:
    response = client.post("/v1/search", json={"query": query, "collections": [collection], **body})
    assert response.status_code == 200, response.text
    return response.json()["results"]


def test_bm25_finds_an_exact_rare_name_that_dense_search_misses(client):
    collection = _collection()
    _ingest(
        client,
        collection,
        *(
            f"Ferry timetable {i}: the morning ferry to the island leaves the harbour at {i} "
            "o'clock and returns at noon."
            for i in range(FERRIES)
        ),
    )
    (target,) = _ingest(
        client, collection, "The invoice lists the pigment zorvanthine, shipped in a crate."
    )
    query = "zorvanthine ferry"
    everything = FERRIES + 1

    def rank(mode: str) -> int:
        found = _search(client, collection, query, top_k=everything, retrieval=mode)
        return [r["doc_id"] for r in found].index(target)

    assert rank("dense") >= 3  # the ferries are closer in meaning
    assert rank("bm25") == 0
    # Fused, the ferries that both lists rank well still come first, but the name lifts it.
    assert rank("hybrid") < rank("dense")


def test_scores_are_cosine_bm25_or_fused_rank_per_mode_best_first(client):
    collection = _collection()
    _ingest(
        client,
        collection,
        "Selvik harbour has a long pier.",
        "Selvik Selvik: the harbour of Selvik.",
        "A mill stands on the hill.",
    )
    scores = {
        mode: [r["score"] for r in _search(client, collection, "Selvik", top_k=3, retrieval=mode)]
        for mode in ("dense", "bm25", "hybrid")
    }
    for mode, values in scores.items():
        assert values == sorted(values, reverse=True), mode
    assert all(-1.0 <= s <= 1.0 for s in scores["dense"])
    assert len(scores["bm25"]) == 2 and all(s > 0 for s in scores["bm25"])  # -BM25
    assert all(0 < s <= 2 / 61 for s in scores["hybrid"])  # 1/(60+rank) from each list


def test_min_score_filters_hybrid_results_by_cosine_and_is_refused_with_bm25(client):
    collection = _collection()
    _ingest(client, collection, "Selvik harbour has a long pier.", "Quorvent tower, Selvik.")
    everything = _search(client, collection, "Selvik harbour pier", top_k=5, retrieval="hybrid")
    assert len(everything) == 2
    kept = _search(
        client, collection, "Selvik harbour pier", top_k=5, retrieval="hybrid", min_score=0.99
    )
    assert kept == []
    refused = client.post(
        "/v1/search", json={"query": "Selvik", "retrieval": "bm25", "min_score": 0.1}
    )
    assert refused.status_code == 422 and "min_score" in refused.json()["detail"]


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_a_second_hop_brings_the_chunk_named_by_the_first_hops_chunk(client, mode):
    collection = _collection()
    bridge, answer, *_ = _ingest(
        client,
        collection,
        "The city of Braigi? It is Houstom.",
        "The river of Houstom? It is Velkar.",
        "The river of Tamsin? It is Orlo.",
        "The city of Pelda? It is Tamsin.",
        "The job of Braigi? It is baker.",
    )
    question = "What is the river of the city of Braigi?"
    one = _search(client, collection, question, top_k=1, retrieval=mode)
    assert [r["doc_id"] for r in one] == [bridge] and one[0]["hop"] == 1
    two = _search(client, collection, question, top_k=1, retrieval=mode, hops=2)
    assert [(r["doc_id"], r["hop"]) for r in two] == [(bridge, 1), (answer, 2)]


def test_a_second_hop_stays_in_the_searched_collections_and_repeats_no_chunk(client):
    collection, other = _collection(), _collection()
    (bridge,) = _ingest(client, collection, "The city of Braigi? It is Houstom.")
    _ingest(client, other, "The river of Houstom? It is Velkar.")
    found = _search(
        client,
        collection,
        "What is the river of the city of Braigi?",
        top_k=3,
        retrieval="bm25",
        hops=2,
    )
    assert [r["doc_id"] for r in found] == [bridge]


HOSTILE = ['"', "AND", "*", "NEAR(", 'NEAR("a" "b", 2)', "a OR", "(((", "^x", "col:x", "-", "?!"]


def test_fts5_syntax_in_queries_is_searched_as_text_never_a_server_error(client):
    collection = _collection()
    _ingest(client, collection, "AND or NEAR: the words of a query language.")
    for mode in ("bm25", "hybrid"):
        for query in HOSTILE:
            response = client.post(
                "/v1/search",
                json={"query": query, "collections": [collection], "retrieval": mode, "hops": 2},
            )
            assert response.status_code == 200, (mode, query, response.text)
    words = _search(client, collection, 'NEAR("and"', top_k=3, retrieval="bm25")
    assert len(words) == 1
    assert _search(client, collection, "?!", top_k=3, retrieval="bm25") == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"hops": 3}, "hops"),
        ({"hops": 0}, "hops"),
        ({"retrieval": "sparse"}, "retrieval"),
        ({"retrieval": None, "hops": "two"}, "hops"),
    ],
)
def test_a_bad_retrieval_or_hop_count_is_422_naming_it(client, body, field):
    response = client.post("/v1/search", json={"query": "Selvik", "top_k": 2, **body})
    assert response.status_code == 422, response.text
    assert field in response.text
