"""Collections against the real process: documents keyed by (collection, doc_id), every route
scoped by `?collection=`, searches filtered by `collections`, and a data dir of the schema
without collections opening with its documents in "default"."""

from __future__ import annotations

import sqlite3
import uuid

import numpy as np
import pytest

from retriever.service import CATALOG_FILE


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"a-{tag}", f"b-{tag}"


def _search(client, **body) -> list[dict]:
    response = client.post("/v1/search", json={"top_k": 10, **body})
    assert response.status_code == 200, response.text
    return response.json()["results"]


def test_the_same_text_in_two_collections_is_two_documents(client):
    a, b = _names()
    text = f"The Selvik mill has eleven sails [{a}]."
    in_a = client.post("/v1/documents", params={"collection": a}, json={"text": text}).json()
    in_b = client.post("/v1/documents", params={"collection": b}, json={"text": text}).json()
    assert in_a["doc_id"] == in_b["doc_id"] and in_a["chunk_ids"] == in_b["chunk_ids"]
    assert (in_a["collection"], in_b["collection"]) == (a, b)
    assert in_b["status"] == "created"
    both = _search(client, query=text, collections=[a, b])
    assert sorted(r["collection"] for r in both if r["doc_id"] == in_a["doc_id"]) == [a, b]
    assert all(r["num_tokens"] > 0 for r in both)

    deleted = client.delete(f"/v1/documents/{in_a['doc_id']}", params={"collection": a})
    assert deleted.json() == {"collection": a, "doc_id": in_a["doc_id"], "deleted_chunks": 1}
    assert (
        client.get(f"/v1/documents/{in_a['doc_id']}", params={"collection": a}).status_code == 404
    )
    kept = client.get(f"/v1/documents/{in_b['doc_id']}", params={"collection": b}).json()
    assert kept["collection"] == b and kept["chunks"][0]["text"] == text
    assert [r["collection"] for r in _search(client, query=text, collections=[a, b])][:1] == [b]
    assert _search(client, query=text, collections=[a]) == []


def test_listing_getting_and_deleting_are_scoped_by_collection(client):
    a, b = _names()
    doc_id = f"shared-{a}"
    for collection in (a, b):
        client.post(
            "/v1/documents",
            params={"collection": collection},
            json={"text": f"Document of {collection}.", "id": doc_id},
        )
    client.post("/v1/documents", params={"collection": a}, json={"text": f"Second {a}."})
    listing = client.get("/v1/documents", params={"collection": a}).json()
    assert listing["total"] == 2
    assert {d["collection"] for d in listing["documents"]} == {a}
    detail = client.get(f"/v1/documents/{doc_id}", params={"collection": b}).json()
    assert detail["chunks"][0]["text"] == f"Document of {b}."
    assert client.get(f"/v1/documents/{doc_id}").status_code == 404  # not in "default"
    missing = client.delete(f"/v1/documents/{doc_id}", params={"collection": f"c-{a}"})
    assert missing.status_code == 404
    assert client.get("/v1/documents", params={"collection": b}).json()["total"] == 1


def test_a_collection_filter_still_returns_top_k_from_the_allowed_collections(client):
    a, b = _names()
    topic = f"Harbour of Tovik {a}: the pier is {{}} metres long and built of oak."
    for i in range(20):  # closer to the query than anything in `a`
        client.post("/v1/documents", params={"collection": b}, json={"text": topic.format(i)})
    for i in range(4):
        client.post(
            "/v1/documents",
            params={"collection": a},
            json={"text": f"Inland fact {i} [{a}]: the forest of Tovik has {i} wells."},
        )
    query = f"How long is the pier of the harbour of Tovik {a}?"
    results = _search(client, query=query, top_k=3, collections=[a])
    assert len(results) == 3 and {r["collection"] for r in results} == {a}
    everywhere = _search(client, query=query, top_k=3)
    assert {r["collection"] for r in everywhere} == {b}


def test_doc_ids_are_looked_up_in_the_searched_collections(client):
    a, b = _names()
    body = client.post("/v1/documents", params={"collection": a}, json={"text": f"Fact {a}."})
    doc_id = body.json()["doc_id"]
    assert _search(client, query="fact", doc_ids=[doc_id], collections=[a])
    response = client.post(
        "/v1/search", json={"query": "fact", "doc_ids": [doc_id], "collections": [b]}
    )
    assert response.status_code == 404
    assert response.json()["detail"] == f"unknown doc_id '{doc_id}' in collection '{b}'"


@pytest.mark.parametrize("name", ["Upper", "-lead", "a" * 65, "with space", "sl/ash", ""])
def test_a_bad_collection_name_is_422_on_every_route(client, name):
    params = {"collection": name}
    for response in (
        client.post("/v1/documents", params=params, json={"text": "x"}),
        client.get("/v1/documents", params=params),
        client.get("/v1/documents/x", params=params),
        client.delete("/v1/documents/x", params=params),
    ):
        assert response.status_code == 422, response.text
        assert "collection" in response.json()["detail"]


# The catalog of schema 1, as the retriever before collections created it.
_SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE documents (
    doc_id TEXT PRIMARY KEY, content_sha256 TEXT NOT NULL, metadata TEXT NOT NULL,
    num_chars INTEGER NOT NULL, num_chunks INTEGER NOT NULL, num_tokens INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL REFERENCES documents(doc_id),
    position INTEGER NOT NULL, chunk_id TEXT NOT NULL, text TEXT NOT NULL,
    num_tokens INTEGER NOT NULL, start_char INTEGER NOT NULL, end_char INTEGER NOT NULL,
    embedding BLOB NOT NULL, UNIQUE (doc_id, position)
);
CREATE INDEX chunks_by_chunk_id ON chunks (chunk_id);
INSERT INTO meta VALUES ('schema_version', '1'), ('generation', '3');
"""


def test_a_data_dir_of_schema_1_opens_with_its_documents_in_default(spawn_retriever, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    vector = np.zeros(384, dtype=np.float32)  # all-MiniLM-L6-v2's dimension
    vector[0] = 1.0
    with sqlite3.connect(data_dir / CATALOG_FILE) as conn:
        conn.executescript(_SCHEMA_V1)
        conn.execute("INSERT INTO documents VALUES ('old-doc', 'sha', '{\"k\": 1}', 9, 1, 3, 1.0)")
        conn.execute(
            "INSERT INTO chunks VALUES (7, 'old-doc', 0, 'cid', 'Old text.', 3, 0, 9, ?)",
            (vector.tobytes(),),
        )
        # Rowids 8-100 belonged to chunks deleted before: they must never come back.
        conn.execute("UPDATE sqlite_sequence SET seq = 100 WHERE name = 'chunks'")
    service = spawn_retriever(data_dir)
    with service.client() as http:
        detail = http.get("/v1/documents/old-doc").json()
        assert (detail["collection"], detail["metadata"]) == ("default", {"k": 1})
        assert detail["chunks"][0]["text"] == "Old text."
        results = http.post("/v1/search", json={"query": "anything", "top_k": 1}).json()
        assert results["results"][0]["doc_id"] == "old-doc"
        assert http.post("/v1/documents", json={"text": "New text."}).status_code == 200
    assert "migrated to schema 2" in service.log()
    with sqlite3.connect(data_dir / CATALOG_FILE) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM chunks ORDER BY id")]
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert ids[0] == 7 and ids[1] > 100
    assert version == ("2",)
