"""Crash consistency of the real process: killed mid-ingest or after writes its index file
lacks, it restarts with catalog and index agreeing and each document whole or absent."""

from __future__ import annotations

import signal
import threading
import time

import httpx

BASELINE = [
    f"Baseline fact {i}: the tower of Ravensholm {i} is {40 + i} metres tall." for i in range(5)
]
# ~2,000 chunks of at most 64 tokens: embedding them takes seconds, so the kill lands mid-way.
LARGE_DOC = "\n\n".join(
    f"Ledger entry {i}: the granary at Holmfjord stored {i * 17 % 1000} sacks of barley, "
    f"{i * 7 % 300} sacks of rye and {i % 50} barrels of salted herring in week {i % 52}."
    for i in range(2500)
)
KILL_AFTER_S = 1.5


def _consistent(http: httpx.Client) -> dict:
    health = http.get("/health").json()
    assert health["index_vectors"] == health["chunks"]
    return health


def test_kill_during_a_large_ingest_leaves_the_document_whole_or_absent(spawn_retriever, tmp_path):
    data_dir = tmp_path / "data"
    args = ("--index", "hnsw", "--chunk-tokens", "64")
    first = spawn_retriever(data_dir, *args)
    with first.client() as http:
        baseline_ids = [
            http.post("/v1/documents", json={"text": t}).json()["doc_id"] for t in BASELINE
        ]

    outcome: dict[str, object] = {}

    def post_large() -> None:
        try:
            with first.client(timeout_s=300) as http:
                outcome["response"] = http.post(
                    "/v1/documents", json={"text": LARGE_DOC, "id": "large"}
                )
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    poster = threading.Thread(target=post_large)
    poster.start()
    time.sleep(KILL_AFTER_S)
    first.stop(signal.SIGKILL)
    poster.join(timeout=30)
    assert "response" not in outcome, "the ingest finished before the kill: make it larger"

    second = spawn_retriever(data_dir, *args)
    with second.client() as http:
        health = _consistent(http)
        large = http.get("/v1/documents/large")
        if large.status_code == 200:  # committed just before the kill: then all of it
            detail = large.json()
            assert len(detail["chunks"]) == detail["num_chunks"] > 1000
            assert detail["chunks"][-1]["end_char"] == len(LARGE_DOC)
        else:
            assert large.status_code == 404
            assert health["documents"] == len(BASELINE)
        for doc_id, text in zip(baseline_ids, BASELINE, strict=True):
            results = http.post("/v1/search", json={"query": text, "top_k": 1}).json()["results"]
            assert results[0]["doc_id"] == doc_id
        # Still writable after the crash.
        assert http.post("/v1/documents", json={"text": "After the crash."}).status_code == 200
        _consistent(http)


def test_writes_after_the_last_index_save_are_recovered_from_the_catalog(spawn_retriever, tmp_path):
    data_dir = tmp_path / "data"
    args = ("--index", "hnsw")
    no_saves = {"RAGBLEND_RETRIEVER_INDEX_SAVE_INTERVAL_S": "0"}  # only at a clean stop
    first = spawn_retriever(data_dir, *args, env=no_saves)
    with first.client() as http:
        ids = [http.post("/v1/documents", json={"text": t}).json()["doc_id"] for t in BASELINE]
    first.stop(signal.SIGTERM)  # saves an index holding the five baseline documents

    second = spawn_retriever(data_dir, *args, env=no_saves)
    added_text = "Added after the save: the Ravensholm ferry leaves at dawn."
    with second.client() as http:
        added = http.post("/v1/documents", json={"text": added_text}).json()["doc_id"]
        assert http.delete(f"/v1/documents/{ids[0]}").status_code == 200
    second.stop(signal.SIGKILL)  # the index file on disk still has ids[0] and lacks `added`

    third = spawn_retriever(data_dir, *args)
    with third.client() as http:
        assert _consistent(http)["documents"] == len(BASELINE)
        top = http.post("/v1/search", json={"query": added_text, "top_k": 1}).json()["results"]
        assert top[0]["doc_id"] == added
        results = http.post("/v1/search", json={"query": BASELINE[0], "top_k": 10}).json()
        assert ids[0] not in {r["doc_id"] for r in results["results"]}
    assert "index reconciled with the catalog: 1 added, 1 removed" in third.log()
