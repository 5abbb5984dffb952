"""POST /v1/chunk: texts split exactly as an ingested document is split (the same chunk ids),
stored nowhere; more chunks than one generation carries, or a bad body, is a 422."""

from __future__ import annotations

import uuid

from common.contract import MAX_CHUNK_TEXTS, MAX_GENERATE_CHUNKS


def test_a_text_is_chunked_as_its_ingested_document_is(client):
    text = " ".join(f"Sentence {i} tells of the river {uuid.uuid4().hex[:6]}." for i in range(80))
    response = client.post("/v1/chunk", json={"texts": [text, "A short one."]})
    assert response.status_code == 200, response.text
    long, short = response.json()["chunks"]
    assert len(long) > 1 and len(short) == 1 and short[0]["text"] == "A short one."
    assert all(0 < c["num_tokens"] <= 128 for c in long)  # the service's chunk_tokens

    ingested = client.post("/v1/documents", json={"text": text, "id": uuid.uuid4().hex})
    assert ingested.status_code == 200, ingested.text
    assert [c["chunk_id"] for c in long] == ingested.json()["chunk_ids"]


def test_chunking_stores_nothing(client):
    text = f"Nothing of {uuid.uuid4().hex} is ever searched."
    assert client.post("/v1/chunk", json={"texts": [text]}).status_code == 200
    found = client.post("/v1/search", json={"query": text, "top_k": 50, "retrieval": "bm25"})
    assert text not in [r["text"] for r in found.json()["results"]]


def test_more_chunks_than_a_generation_carries_is_a_422(spawn_retriever, tmp_path):
    service = spawn_retriever(tmp_path / "data", "--chunk-tokens", "8")
    words = " ".join(f"w{i}" for i in range(8 * MAX_GENERATE_CHUNKS // MAX_CHUNK_TEXTS + 8))
    with service.client() as http:
        response = http.post("/v1/chunk", json={"texts": [words] * MAX_CHUNK_TEXTS})
    assert response.status_code == 422, response.text
    assert "documents" in response.text and str(MAX_GENERATE_CHUNKS) in response.text


def test_no_texts_or_too_many_is_a_422_naming_texts(client):
    for texts in ([], ["x"] * (MAX_CHUNK_TEXTS + 1)):
        response = client.post("/v1/chunk", json={"texts": texts})
        assert response.status_code == 422 and "texts" in response.text
