"""Persistence across restarts of the real process: the same answers after a clean stop,
and after a kill before any index file was written (rebuilt from the catalog)."""

from __future__ import annotations

import signal

import httpx

from retriever.service import INDEX_FILE

FACTS = [
    f"Station {i} of the Norrland survey recorded {i * 13 % 97} millimetres of rain in {1950 + i}."
    for i in range(30)
]
QUERIES = ["rain at station 4", "Norrland survey 1963", "station 17 millimetres", "rainfall"]


def _answers(http: httpx.Client) -> list[list[tuple[str, str, float]]]:
    answers = []
    for query in QUERIES:
        results = http.post("/v1/search", json={"query": query, "top_k": 5}).json()["results"]
        answers.append([(r["chunk_id"], r["doc_id"], round(r["score"], 4)) for r in results])
    return answers


def _state(http: httpx.Client) -> tuple[dict, list[str]]:
    health = http.get("/health").json()
    docs = sorted(d["doc_id"] for d in http.get("/v1/documents").json()["documents"])
    return health, docs


def test_restarted_service_answers_the_same_including_deletes(spawn_retriever, tmp_path):
    data_dir = tmp_path / "data"
    first = spawn_retriever(data_dir)
    with first.client() as http:
        doc_ids = [http.post("/v1/documents", json={"text": t}).json()["doc_id"] for t in FACTS]
        assert http.delete(f"/v1/documents/{doc_ids[4]}").status_code == 200
        before = _answers(http)
        state_before = _state(http)
    # uvicorn shuts down cleanly, then re-raises the signal: the exit code is -SIGTERM.
    assert first.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in first.log()
    assert (data_dir / INDEX_FILE).exists()

    second = spawn_retriever(data_dir)
    with second.client() as http:
        assert _answers(http) == before
        assert _state(http) == state_before
        assert http.get(f"/v1/documents/{doc_ids[4]}").status_code == 404
        assert http.get(f"/v1/documents/{doc_ids[5]}").status_code == 200
    assert "index " in second.log() and "is current" in second.log()


def test_killed_service_without_index_file_rebuilds_it_from_the_catalog(spawn_retriever, tmp_path):
    data_dir = tmp_path / "data"
    no_saves = {"RAGBLEND_RETRIEVER_INDEX_SAVE_INTERVAL_S": "0"}  # only at a clean stop
    first = spawn_retriever(data_dir, "--index", "hnsw", env=no_saves)
    with first.client() as http:
        for text in FACTS:
            assert http.post("/v1/documents", json={"text": text}).status_code == 200
        before = _answers(http)
        state_before = _state(http)
    first.stop(signal.SIGKILL)
    assert not (data_dir / INDEX_FILE).exists()

    second = spawn_retriever(data_dir, "--index", "hnsw")
    with second.client() as http:
        assert _answers(http) == before
        assert _state(http) == state_before
