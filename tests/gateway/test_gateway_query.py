"""POST /v1/query end to end over the real retriever and engine: JSON and SSE."""

from __future__ import annotations

import json

import pytest

from tests.gateway.gateway_testutil import parse_sse


def test_query_answers_with_the_retrieved_sources_usage_and_timings(client, documents):
    response = client.post(
        "/v1/query",
        json={
            "question": "Where does the Zorblax river flow?",
            "top_k": 2,
            "max_tokens": 4,
            # Other tests ingest into the shared retriever; BM25 may rank their chunks second.
            "doc_ids": list(documents),
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["answer"], str) and body["finish_reason"] in ("length", "stop")
    assert len(body["sources"]) == 2
    assert body["sources"][0]["doc_id"] == "rivers"
    known = {c for ids in documents.values() for c in ids}
    assert all(s["chunk_id"] in known and s["text"] for s in body["sources"])
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 4
    # The chunks were precomputed at ingestion, so blending reuses their KV.
    assert usage["cached_tokens"] > 0
    assert body["timings"]["retrieval_s"] > 0 and body["timings"]["ttft_s"] > 0
    assert body["mode"] == "cacheblend"


def test_query_keeps_the_callers_request_id_and_makes_one_when_absent(client, retriever, engine):
    given = client.post(
        "/v1/query", json={"question": "Kessa pass?"}, headers={"X-Request-ID": "trace-42"}
    )
    assert given.headers["X-Request-ID"] == "trace-42"
    assert given.json()["request_id"] == "trace-42"
    assert "[trace-42]: search top_k=" in retriever.log()
    assert "[trace-42]: generated mode=" in engine.log()
    made = client.post("/v1/query", json={"question": "Kessa pass?"})
    assert len(made.headers["X-Request-ID"]) == 32


def test_query_searches_only_the_given_doc_ids_in_the_given_mode(client):
    response = client.post(
        "/v1/query",
        json={
            "question": "Where does the Zorblax river flow?",
            "doc_ids": ["orchards"],
            "mode": "full_prefill",
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert {s["doc_id"] for s in body["sources"]} == {"orchards"}
    assert body["mode"] == "full_prefill" and body["usage"]["cached_tokens"] == 0


def test_streamed_query_sends_sources_then_deltas_then_the_result_as_sse(client):
    with client.stream(
        "POST",
        "/v1/query",
        json={
            "question": "When is the harvest festival?",
            "max_tokens": 5,
            "stream": True,
        },
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    frames = parse_sse(text)
    events = [event for event, _ in frames]
    assert events[0] == "sources" and events[-1] == "result"
    assert set(events[1:-1]) <= {"delta"} and len(events) >= 3
    deltas = "".join(json.loads(data)["text"] for event, data in frames if event == "delta")
    result = json.loads(frames[-1][1])
    assert result["answer"] == deltas
    assert json.loads(frames[0][1])["sources"] == result["sources"]
    assert result["usage"]["completion_tokens"] == 5 or result["finish_reason"] == "stop"


def test_query_penalties_reach_the_engine_and_unset_ones_keep_its_defaults(client, documents):
    def answer(**penalties) -> str:
        body = {
            "question": "Where does the Zorblax river flow?",
            "mode": "full_prefill",
            "max_tokens": 16,
            "doc_ids": list(documents),
            **penalties,
        }
        response = client.post("/v1/query", json=body)
        assert response.status_code == 200, response.text
        return response.json()["answer"]

    plain = answer()
    assert answer(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0) == plain
    assert answer(repetition_penalty=2.0) != plain
    assert answer(frequency_penalty=2.0, presence_penalty=2.0) != plain


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.1),
    ],
)
def test_query_penalties_out_of_range_are_a_422_naming_the_field(client, field, value):
    response = client.post("/v1/query", json={"question": "Kessa pass?", field: value})
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]
