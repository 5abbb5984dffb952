"""The official openai client against /v1/chat/completions, /v1/completions and /v1/models."""

from __future__ import annotations

import pytest
from openai import OpenAI


@pytest.fixture
def openai_client(gateway, documents):
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_completion_answers_with_usage_counting_reused_chunk_tokens(openai_client):
    reply = openai_client.chat.completions.create(
        model="ragblend",
        max_tokens=4,
        temperature=0,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where does the Zorblax river flow?"},
        ],
        extra_body={"rag": {"top_k": 2, "mode": "cacheblend"}},
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("length", "stop")
    usage = reply.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert [s["doc_id"] for s in reply.model_extra["rag"]["sources"]][0] == "rivers"


def test_streamed_chat_completion_ends_with_a_usage_chunk_when_asked(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="ragblend",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "What grows in the Melbrook valley?"}],
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_completion_has_no_usage_chunk_unless_asked(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="ragblend",
            max_tokens=3,
            stream=True,
            messages=[{"role": "user", "content": "What grows in the Melbrook valley?"}],
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.usage is None for c in chunks)


def test_completion_answers_the_prompt_streamed_and_not(openai_client):
    reply = openai_client.completions.create(
        model="ragblend",
        prompt="Which pass crosses the Vantir mountains?",
        max_tokens=4,
    )
    assert reply.object == "text_completion" and isinstance(reply.choices[0].text, str)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(
        openai_client.completions.create(
            model="ragblend",
            prompt="Which pass crosses the Vantir mountains?",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens >= 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert isinstance(text, str)


def test_models_lists_the_configured_model_name_and_its_no_rag_id(openai_client):
    assert [m.id for m in openai_client.models.list()] == ["ragblend", "ragblend-no-rag"]


def test_streamed_chat_completion_ends_with_done(client):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "ragblend",
            "max_tokens": 2,
            "stream": True,
            "messages": [{"role": "user", "content": "Kessa pass?"}],
        },
    ) as response:
        text = response.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in text.strip().split("\n\n"))


def test_chat_completion_penalties_reach_the_engine(openai_client):
    def answer(extra: dict | None = None, **sampling) -> str:
        reply = openai_client.chat.completions.create(
            model="ragblend",
            max_tokens=16,
            temperature=0,
            messages=[{"role": "user", "content": "Where does the Zorblax river flow?"}],
            extra_body={"rag": {"mode": "full_prefill"}, **(extra or {})},
            **sampling,
        )
        return reply.choices[0].message.content

    plain = answer()
    assert answer(frequency_penalty=2.0, presence_penalty=2.0) != plain
    # repetition_penalty is vLLM's extension: the openai client sends it in extra_body.
    assert answer(extra={"repetition_penalty": 2.0}) != plain
    assert answer(frequency_penalty=0.0, extra={"repetition_penalty": 1.0}) == plain


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 2.5), ("presence_penalty", -2.5), ("repetition_penalty", 0)],
)
def test_openai_penalties_out_of_range_are_a_422_naming_the_field(client, field, value):
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Kessa pass?"}]}),
        ("/v1/completions", {"prompt": "Kessa pass?"}),
    ):
        response = client.post(path, json={**body, "max_tokens": 2, field: value})
        assert response.status_code == 422, response.text
        assert field in response.json()["detail"]


CHAT = {"messages": [{"role": "user", "content": "Kessa pass?"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"42": 10}}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"top_k": 5}, "top_k"),
    ],
)
def test_a_field_that_would_change_the_output_and_is_unsupported_is_a_400_naming_it(
    client, fields, named
):
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "Kessa pass?", "max_tokens": 2}),
    ):
        response = client.post(path, json={**body, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["detail"].startswith(f"not supported: {named} ")
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_harmless_fields_and_what_asks_for_nothing_are_accepted(client):
    harmless = {"user": "u-1", "metadata": {"app": "x"}, "store": False}
    nothing = {"logprobs": False, "response_format": {"type": "text"}, "tool_choice": "none"}
    response = client.post("/v1/chat/completions", json={**CHAT, **harmless, **nothing})
    assert response.status_code == 200, response.text


def test_a_request_without_temperature_gets_the_engines_default_not_openais(client):
    # The tiny model sets no sampling defaults: the engine decodes greedily, where OpenAI's
    # 1.0 would sample.
    plain = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 16}).json()
    greedy = client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 16, "temperature": 0}
    ).json()
    assert plain["choices"][0]["message"] == greedy["choices"][0]["message"]
