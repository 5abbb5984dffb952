"""Prompts fitted to the model: the engine drops the worst chunks (fit_context) and every
answer says how many; a max_tokens that cannot fit at all is the gateway's 422. The kept chunks
go into the prompt in the request's chunk_order (or the gateway's setting)."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

MAX_MODEL_LEN = 8192  # the served tiny model's positions (tests/conftest.py)
TOP_K = 4


@pytest.fixture(scope="module")
def crowding_question(tiny_model) -> str:
    """A question that leaves room for about two of the four 48-token chunks beside 4 answer
    tokens and the prompt's frame (about 70 tokens: instructions, separators)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    target = MAX_MODEL_LEN - 4 - 190
    words = ["Quendor", "river", "pass", "pears"] * 4000
    low, high = 0, len(words)  # the most words whose tokens stay under the target
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:middle]))) < target:
            low = middle
        else:
            high = middle - 1
    words = words[:low]
    return " ".join(words)


def test_chunks_that_do_not_fit_are_dropped_worst_first_and_counted(client, crowding_question):
    answer = client.post(
        "/v1/query", json={"question": crowding_question, "top_k": TOP_K, "max_tokens": 4}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert 1 <= body["dropped_sources"] <= TOP_K
    assert len(body["sources"]) + body["dropped_sources"] == TOP_K
    scores = [s["score"] for s in body["sources"]]
    assert scores == sorted(scores, reverse=True)  # the best kept


def test_openai_routes_report_dropped_sources(client, crowding_question):
    reply = client.post(
        "/v1/completions",
        json={"prompt": crowding_question, "max_tokens": 2, "rag": {"top_k": TOP_K}},
    )
    assert reply.status_code == 200, reply.text
    rag = reply.json()["rag"]
    assert rag["dropped_sources"] >= 1 and len(rag["sources"]) + rag["dropped_sources"] == TOP_K
    with client.stream(
        "POST",
        "/v1/completions",
        json={"prompt": crowding_question, "max_tokens": 2, "stream": True, "rag": {"top_k": 4}},
    ) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if "rag" in line]
    assert chunks[-1]["rag"]["dropped_sources"] >= 1


def test_nothing_is_dropped_when_everything_fits(client):
    body = client.post("/v1/query", json={"question": "Kessa pass?", "max_tokens": 2}).json()
    assert body["dropped_sources"] == 0 and len(body["sources"]) == 2


def test_max_tokens_that_cannot_fit_the_model_is_the_gateways_422(spawn_gateway, engine):
    gateway = spawn_gateway(engine, args=("--max-tokens-limit", "100000"))
    with gateway.client() as http:
        for path, body in (
            ("/v1/query", {"question": "x", "max_tokens": MAX_MODEL_LEN}),
            ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 422, response.text
            assert "max_model_len" in response.json()["detail"]


def engine_answer(engine, question: str, texts: list[str]) -> str:
    body = {
        "question": question,
        "chunks": [{"id": f"c{i}", "text": text} for i, text in enumerate(texts)],
        "max_tokens": 6,
        "mode": "full_prefill",
    }
    reply = httpx.post(f"{engine.url}/v1/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["text"]


def test_chunk_order_lays_out_the_best_chunk_first_or_next_to_the_question(client, engine):
    question = "Kessa pass?"
    ask = {"question": question, "max_tokens": 6, "mode": "full_prefill"}
    answers = {}
    for order in ("best_first", "best_last"):
        body = client.post("/v1/query", json={**ask, "chunk_order": order}).json()
        scores = [s["score"] for s in body["sources"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)  # sources: best first
        answers[order] = body["answer"]
    texts = [s["text"] for s in body["sources"]]
    assert answers["best_first"] == engine_answer(engine, question, texts)
    assert answers["best_last"] == engine_answer(engine, question, texts[::-1])
    assert answers["best_first"] != answers["best_last"]  # the order reached the engine
    # The gateway's default (best_last) applies when the request names none.
    assert client.post("/v1/query", json=ask).json()["answer"] == answers["best_last"]
    wrong = client.post("/v1/query", json={**ask, "chunk_order": "worst_first"})
    assert wrong.status_code == 422 and "chunk_order" in wrong.text
