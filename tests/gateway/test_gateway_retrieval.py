"""The gateway passes `retrieval` and `hops` (else its `default_hops`) on to the real retriever,
from POST /v1/query and from the OpenAI routes' `rag` extension, and refuses values the
retriever would not take."""

from __future__ import annotations

import re

import pytest

# Only the "rivers" document names the Zorblax river: BM25 finds it alone, while dense search
# fills top_k with the nearest other documents too.
RARE_NAME = "Zorblax?"


def test_query_searches_in_the_retrieval_mode_and_hops_it_names(client, retriever):
    response = client.post(
        "/v1/query",
        json={"question": RARE_NAME, "top_k": 2, "retrieval": "bm25", "hops": 2},
        headers={"X-Request-ID": "hybrid-pass-1"},
    )
    assert response.status_code == 200, response.text
    assert [s["doc_id"] for s in response.json()["sources"]][:1] == ["rivers"]
    assert "[hybrid-pass-1]: search top_k=2 retrieval=bm25 hops=2" in retriever.log()

    dense = client.post(
        "/v1/query", json={"question": RARE_NAME, "top_k": 2, "retrieval": "dense"}
    ).json()
    assert len(dense["sources"]) == 2
    bm25 = client.post(
        "/v1/query", json={"question": RARE_NAME, "top_k": 2, "retrieval": "bm25"}
    ).json()
    assert [s["doc_id"] for s in bm25["sources"]] == ["rivers"]


def test_default_hops_applies_when_a_request_names_none(
    spawn_gateway, engine, retriever, documents
):
    gateway = spawn_gateway(engine, args=("--default-hops", "2"))
    with gateway.client() as http:
        for request_id, hops in (("default-hops-1", None), ("default-hops-2", 1)):
            body = {"question": RARE_NAME, "top_k": 2, "retrieval": "bm25"}
            if hops is not None:
                body["hops"] = hops
            headers = {"X-Request-ID": request_id}
            assert http.post("/v1/query", json=body, headers=headers).status_code == 200
        chat = {"messages": [{"role": "user", "content": RARE_NAME}], "max_tokens": 2}
        headers = {"X-Request-ID": "default-hops-3"}
        assert http.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
    log = retriever.log()
    assert "[default-hops-1]: search top_k=2 retrieval=bm25 hops=2" in log
    assert "[default-hops-2]: search top_k=2 retrieval=bm25 hops=1" in log
    assert re.search(r"\[default-hops-3\]: search top_k=\d+ retrieval=\w+ hops=2 ", log)


def test_chat_completions_take_retrieval_in_the_rag_extension(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": RARE_NAME}],
            "max_tokens": 2,
            "rag": {"top_k": 2, "retrieval": "bm25"},
        },
    )
    assert response.status_code == 200, response.text
    assert [s["doc_id"] for s in response.json()["rag"]["sources"]] == ["rivers"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/query", {"question": "x", "hops": 3}),
        ("/v1/query", {"question": "x", "retrieval": "sparse"}),
        ("/v1/completions", {"prompt": "x", "rag": {"hops": 0}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "rag": {"retrieval": "x"}},
        ),
    ],
)
def test_a_bad_retrieval_or_hop_count_is_422_at_the_gateway(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert "hops" in response.text or "retrieval" in response.text
