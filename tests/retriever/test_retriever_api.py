"""Each route of the real retriever process: happy paths, idempotence, replacement, delete,
uploads of every file type, and the 4xx answers to bad input."""

from __future__ import annotations

import hashlib
import json
import uuid

import httpx
import pytest


def _unique(text: str) -> str:
    # A fresh token keeps documents of different tests (one shared service) apart.
    return f"{text} [{uuid.uuid4().hex[:8]}]"


def _ingest(client: httpx.Client, text: str, **fields) -> dict:
    response = client.post("/v1/documents", json={"text": text, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _health(client: httpx.Client) -> dict:
    return client.get("/health").json()


def test_ingest_returns_content_hash_ids_and_search_finds_the_chunk(client):
    text = _unique("The lighthouse of Varnholm was painted green in 1887.")
    body = _ingest(client, text, metadata={"source": "test"})
    sha = hashlib.sha256(text.encode()).hexdigest()
    assert body["doc_id"] == sha[:32]
    assert body["chunk_ids"] == [sha[:32]]  # one chunk holding the whole text
    assert body["status"] == "created"
    question = "What colour was the Varnholm lighthouse?"
    results = client.post(
        "/v1/search", json={"query": question, "top_k": 3, "retrieval": "dense"}
    ).json()["results"]
    assert results[0] == {
        "chunk_id": sha[:32],
        "collection": "default",
        "doc_id": sha[:32],
        "score": pytest.approx(results[0]["score"]),
        "text": text,
        "num_tokens": body["num_tokens"],
        "hop": 1,
    }
    assert 0.3 < results[0]["score"] <= 1.0  # cosine similarity


def test_reingesting_the_same_document_creates_nothing_new(client):
    text = _unique("Idempotence: the Kelvara bridge has nine arches.")
    first = _ingest(client, text)
    before = _health(client)
    again = _ingest(client, text)
    after = _health(client)
    assert again["doc_id"] == first["doc_id"] and again["chunk_ids"] == first["chunk_ids"]
    assert again["status"] == "unchanged"
    assert (after["documents"], after["chunks"], after["index_vectors"]) == (
        before["documents"],
        before["chunks"],
        before["index_vectors"],
    )


def test_ingesting_new_text_under_an_existing_id_replaces_its_chunks(client):
    doc_id = f"replace-{uuid.uuid4().hex[:8]}"
    old = _ingest(client, "The Ostrava ferry leaves at nine.", id=doc_id)
    new = _ingest(client, "The Ostrava ferry now leaves at eleven.", id=doc_id)
    assert new["doc_id"] == doc_id and new["status"] == "replaced"
    hits = client.post("/v1/search", json={"query": "ferry", "top_k": 5, "doc_ids": [doc_id]})
    assert [h["chunk_id"] for h in hits.json()["results"]] == new["chunk_ids"]
    assert old["chunk_ids"] != new["chunk_ids"]


def test_long_document_is_chunked_into_substrings_within_the_token_budget(client):
    text = "\n\n".join(
        " ".join(f"Section {p} line {s} records the tide height {p * 7 + s} cm." for s in range(6))
        for p in range(25)
    )
    body = _ingest(client, text, id=f"long-{uuid.uuid4().hex[:8]}")
    detail = client.get(f"/v1/documents/{body['doc_id']}").json()
    assert detail["num_chunks"] == len(body["chunk_ids"]) > 5
    for chunk in detail["chunks"]:
        assert text[chunk["start_char"] : chunk["end_char"]] == chunk["text"]
        assert chunk["num_tokens"] <= 128  # the shared service runs with --chunk-tokens 128
        assert chunk["chunk_id"] == hashlib.sha256(chunk["text"].encode()).hexdigest()[:32]


def test_list_shows_documents_with_metadata(client):
    body = _ingest(client, _unique("Listed document."), metadata={"team": "blue", "n": 3})
    listing = client.get("/v1/documents", params={"limit": 100000}).json()
    entry = next(d for d in listing["documents"] if d["doc_id"] == body["doc_id"])
    assert entry["metadata"] == {"team": "blue", "n": 3}
    assert entry["num_chunks"] == 1
    assert listing["total"] >= len(listing["documents"]) >= 1


def test_delete_removes_the_document_its_chunks_and_vectors(client):
    text = _unique("Deleted fact: the Morrowind ferry carries 40 horses.")
    body = _ingest(client, text)
    before = _health(client)
    response = client.delete(f"/v1/documents/{body['doc_id']}")
    assert response.json() == {
        "collection": "default",
        "doc_id": body["doc_id"],
        "deleted_chunks": 1,
    }
    after = _health(client)
    assert after["chunks"] == before["chunks"] - 1
    assert after["index_vectors"] == before["index_vectors"] - 1
    assert client.get(f"/v1/documents/{body['doc_id']}").status_code == 404
    results = client.post("/v1/search", json={"query": text, "top_k": 10}).json()["results"]
    assert body["doc_id"] not in {r["doc_id"] for r in results}


def test_search_filters_by_doc_ids_and_min_score(client):
    a = _ingest(client, _unique("Apples grow in the Tarnow orchard."))
    b = _ingest(client, _unique("Pears grow in the Tarnow orchard."))
    results = client.post(
        "/v1/search", json={"query": "Tarnow orchard", "top_k": 10, "doc_ids": [b["doc_id"]]}
    ).json()["results"]
    assert [r["doc_id"] for r in results] == [b["doc_id"]]
    results = client.post(
        "/v1/search", json={"query": "Tarnow orchard", "top_k": 10, "min_score": 0.99}
    ).json()["results"]
    assert results == []
    results = client.post(
        "/v1/search",
        json={
            "query": "Tarnow orchard apples",
            "top_k": 2,
            "doc_ids": [a["doc_id"], b["doc_id"]],
            "min_score": 0.2,
            "retrieval": "dense",  # scores are then the cosine that min_score bounds
        },
    ).json()["results"]
    assert [r["doc_id"] for r in results][0] == a["doc_id"]
    assert all(r["score"] >= 0.2 for r in results)


@pytest.mark.parametrize(
    ("filename", "content", "expected_text"),
    [
        ("notes.txt", b"Plain text about TAG.", "Plain text about TAG."),
        ("notes.md", b"# TAG\n\nMarkdown body.", "# TAG\n\nMarkdown body."),
        (
            "page.html",
            b"<html><head><title>U</title><script>x()</script></head>"
            b"<body><p>HTML <i>about</i> TAG.</p></body></html>",
            "HTML about TAG.",
        ),
    ],
)
def test_uploaded_files_are_extracted_and_keep_their_metadata(
    client, filename, content, expected_text
):
    tag = f"Ulvik{uuid.uuid4().hex[:6]}"
    response = client.post(
        "/v1/documents",
        files={"file": (filename, content.replace(b"TAG", tag.encode()))},
        data={"metadata": json.dumps({"origin": "upload"})},
    )
    assert response.status_code == 200, response.text
    detail = client.get(f"/v1/documents/{response.json()['doc_id']}").json()
    assert detail["metadata"]["filename"] == filename
    assert detail["metadata"]["origin"] == "upload"
    assert detail["chunks"][0]["text"] == expected_text.replace("TAG", tag)


def test_uploaded_pdf_is_extracted_page_by_page(client, pdf_bytes):
    marker = uuid.uuid4().hex[:6]
    pdf = pdf_bytes([f"Page one {marker}.", f"Page two {marker}."])
    response = client.post(
        "/v1/documents",
        files={"file": ("doc.pdf", pdf, "application/pdf")},
        data={"id": f"pdf-{marker}"},
    )
    assert response.status_code == 200, response.text
    detail = client.get(f"/v1/documents/pdf-{marker}").json()
    assert detail["metadata"]["pages"] == 2
    assert f"Page one {marker}." in detail["chunks"][0]["text"]


@pytest.mark.parametrize(
    ("request_kwargs", "status", "detail_part"),
    [
        ({"url": "/v1/documents", "json": {"text": "   "}}, 422, "text is empty"),
        ({"url": "/v1/documents", "json": {"metadata": {}}}, 422, "text"),
        (
            {"url": "/v1/documents", "files": {"file": ("latin.txt", "café".encode("latin-1"))}},
            422,
            "latin.txt is not valid UTF-8",
        ),
        (
            {"url": "/v1/documents", "files": {"file": ("report.docx", b"PK\x03\x04")}},
            415,
            "unsupported file type '.docx'",
        ),
        (
            {"url": "/v1/documents", "files": {"file": ("empty.txt", b"  \n")}},
            422,
            "empty.txt contains no text",
        ),
        ({"url": "/v1/search", "json": {"query": "x", "top_k": 0}}, 422, "top_k"),
        ({"url": "/v1/search", "json": {"query": "x", "top_k": -3}}, 422, "top_k"),
        ({"url": "/v1/search", "json": {"query": "x", "top_k": 51}}, 422, "max_top_k"),
        ({"url": "/v1/search", "json": {"query": " ", "top_k": 3}}, 422, "query is empty"),
        (
            {"url": "/v1/search", "json": {"query": "x", "top_k": 3, "doc_ids": ["no-such-doc"]}},
            404,
            "unknown doc_id 'no-such-doc'",
        ),
    ],
    ids=[
        "empty-text",
        "missing-text",
        "non-utf8-file",
        "unknown-file-type",
        "empty-file",
        "top-k-zero",
        "top-k-negative",
        "top-k-above-max",
        "empty-query",
        "search-unknown-doc",
    ],
)
def test_bad_input_gets_a_4xx_whose_detail_names_the_problem(
    client, request_kwargs, status, detail_part
):
    response = client.post(**request_kwargs)
    assert response.status_code == status, response.text
    assert detail_part in json.dumps(response.json()["detail"])


def test_unknown_doc_id_gets_404_on_delete_and_get(client):
    for response in (
        client.delete("/v1/documents/no-such-doc"),
        client.get("/v1/documents/no-such-doc"),
    ):
        assert response.status_code == 404
        assert response.json() == {
            "detail": "unknown doc_id 'no-such-doc' in collection 'default'",
            "errors": [],
        }


def test_metrics_expose_search_latency_ingest_counts_and_index_size(client):
    _ingest(client, _unique("Metrics document."))
    client.post("/v1/search", json={"query": "metrics", "top_k": 1})
    text = client.get("/metrics").text
    health = _health(client)
    assert "ragblend_retriever_search_latency_seconds_bucket" in text
    for line in (
        f"ragblend_retriever_index_vectors {float(health['index_vectors'])}",
        f"ragblend_retriever_chunks {float(health['chunks'])}",
    ):
        assert line in text
    ingested = next(
        line
        for line in text.splitlines()
        if line.startswith("ragblend_retriever_documents_ingested_total")
    )
    assert float(ingested.split()[-1]) >= 1
    assert "ragblend_retriever_chunks_ingested_total" in text
