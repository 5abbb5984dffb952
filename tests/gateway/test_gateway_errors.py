"""Bad input gets a 4xx whose detail says what is wrong, on every public route."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"top_k": 2}, "question"),
        ({"question": "   "}, "question"),
        ({"question": "x", "top_k": 0}, "top_k"),
        ({"question": "x", "top_k": 10_000}, "top_k"),
        ({"question": "x", "mode": "magic"}, "mode"),
        ({"question": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"question": "x", "recompute_ratio": 1.5}, "recompute_ratio"),
        ({"question": "x", "surprise": 1}, "surprise"),
    ],
)
def test_bad_query_is_a_422_naming_the_field(client, body, field):
    response = client.post("/v1/query", json=body)
    assert response.status_code == 422
    assert field in response.json()["detail"]


def test_malformed_json_is_a_422_saying_so(client):
    response = client.post(
        "/v1/query", content=b'{"question": ', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert "malformed JSON" in response.json()["detail"]


def test_chat_without_a_user_message_is_a_422_in_openai_form(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": "ragblend",
            "messages": [{"role": "system", "content": "be brief"}],
        },
    )
    assert response.status_code == 422
    body = response.json()
    assert "user message" in body["detail"]
    assert body["error"]["type"] == "invalid_request_error"


def test_chat_with_an_unknown_rag_mode_is_a_422(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "rag": {"mode": "magic"},
        },
    )
    assert response.status_code == 422 and "rag.mode" in response.json()["detail"]


def test_completion_without_a_prompt_is_a_422(client):
    response = client.post("/v1/completions", json={"model": "ragblend"})
    assert response.status_code == 422 and "prompt" in response.json()["detail"]


def test_prompt_too_long_for_the_model_is_the_engines_422(client):
    question = "kalo zu " * 3000  # with max_tokens, beyond the model's 8192 positions
    response = client.post("/v1/query", json={"question": question, "max_tokens": 4000})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("engine")
