"""/v1/documents through the gateway: JSON and upload ingestion with a pollable precompute
status, list, show and delete."""

from __future__ import annotations

from tests.gateway.gateway_testutil import wait_precomputed


def test_json_ingest_goes_pending_then_ready_with_chunks_stored_on_the_engine(client):
    response = client.post(
        "/v1/documents",
        json={
            "text": "The lighthouse of Porvik is painted red and white. Its keeper is Ilsa Dorn.",
            "metadata": {"topic": "lighthouse"},
            "id": "porvik",
        },
    )
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["doc_id"] == "porvik" and created["chunk_ids"]
    assert created["precompute"]["status"] in ("pending", "ready")
    document = wait_precomputed(client, "porvik")
    assert document["precompute"]["status"] == "ready"
    # Engines are named, never shown by URL.
    assert document["precompute"]["engines"]["engine-0"].startswith("stored ")
    assert document["collection"] == "default"
    assert [c["chunk_id"] for c in document["chunks"]] == created["chunk_ids"]
    assert document["metadata"]["topic"] == "lighthouse"


def test_upload_ingest_accepts_the_retrievers_multipart_form(client):
    response = client.post(
        "/v1/documents",
        files={"file": ("notes.txt", b"Harbor notes: the ferry leaves at dawn.")},
        data={"id": "harbor-notes", "metadata": '{"kind": "notes"}'},
    )
    assert response.status_code == 200, response.text
    assert response.json()["doc_id"] == "harbor-notes"
    assert wait_precomputed(client, "harbor-notes")["precompute"]["status"] == "ready"


def test_documents_are_listed_and_deleted(client):
    client.post("/v1/documents", json={"text": "A short-lived note about tin.", "id": "tin"})
    listed = client.get("/v1/documents").json()
    assert "tin" in {d["doc_id"] for d in listed["documents"]}
    deleted = client.delete("/v1/documents/tin")
    assert deleted.status_code == 200 and deleted.json()["deleted_chunks"] >= 1
    assert client.get("/v1/documents/tin").status_code == 404


def test_unknown_document_is_a_404_naming_the_retriever(client):
    response = client.get("/v1/documents/no-such-doc")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("retriever:")


def test_blank_document_is_rejected_with_the_retrievers_422(client):
    response = client.post("/v1/documents", json={"text": "   "})
    assert response.status_code == 422
    assert "text" in str(response.json()["detail"])
