"""The official openai client against /v1/chat/completions, /v1/completions and /v1/models."""

from __future__ import annotations

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from demo.tiny import random_words
from engine.blend.layout import PromptBuilder
from engine.types import Turn


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


MELBROOK = [
    {"role": "user", "content": "What grows in the Melbrook valley?"},
    {"role": "assistant", "content": "Silver pears."},
]


def test_a_chat_sends_its_earlier_turns_rendered_by_the_models_template(openai_client, tiny_model):
    question = "When is its harvest festival?"
    reply = openai_client.chat.completions.create(
        model="ragblend",
        max_tokens=2,
        temperature=0,
        messages=[*MELBROOK, {"role": "user", "content": question}],
        extra_body={"rag": {"top_k": 2, "chunk_order": "best_first"}},
    )
    rag = reply.model_extra["rag"]
    assert rag["dropped_turns"] == 0 and rag["dropped_sources"] == 0
    # The engine's prompt, built here from what the answer says it used: the turns are in it.
    prompts = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model))
    passages = [s["text"] for s in rag["sources"]]
    turns = [Turn(m["role"], m["content"]) for m in MELBROOK]
    assert reply.usage.prompt_tokens == prompts.build(question, passages, history=turns).num_tokens
    assert reply.usage.prompt_tokens > prompts.build(question, passages).num_tokens


@pytest.mark.parametrize(
    ("earlier", "doc_id"),
    [("What grows in the Melbrook valley?", "orchards"), ("Is the Kessa pass open?", "mountains")],
)
def test_a_follow_up_is_retrieved_with_the_user_turn_before_it(openai_client, earlier, doc_id):
    reply = openai_client.chat.completions.create(
        model="ragblend",
        max_tokens=1,
        messages=[
            {"role": "user", "content": earlier},
            {"role": "assistant", "content": "I can tell you."},
            {"role": "user", "content": "Tell me more."},
        ],
        extra_body={"rag": {"top_k": 1, "retrieval": "bm25"}},
    )
    assert [s["doc_id"] for s in reply.model_extra["rag"]["sources"]] == [doc_id]


def test_a_chat_too_long_for_the_model_loses_its_oldest_turns_first_and_says_so(
    spawn_engine, spawn_gateway, documents
):
    gateway = spawn_gateway(spawn_engine("--max-model-len", "384"))
    history = [
        {"role": role, "content": " ".join(random_words(30, 300 + 2 * i + (role == "user")))}
        for i in range(5)
        for role in ("user", "assistant")
    ]
    greeting = {"role": "assistant", "content": "Hello! Ask me about Quendor."}
    question = {"role": "user", "content": "Where does the Zorblax river flow?"}
    ask = {"max_tokens": 4, "temperature": 0, "rag": {"top_k": 1}}
    with gateway.client() as http:
        reply = http.post(
            "/v1/chat/completions", json={**ask, "messages": [greeting, *history, question]}
        )
        assert reply.status_code == 200, reply.text
        rag = reply.json()["rag"]
        dropped = rag["dropped_turns"] - 1  # the greeting is never sent: no user turn before it
        assert dropped in (2, 4, 6, 8) and rag["dropped_sources"] == 0
        kept = http.post(
            "/v1/chat/completions", json={**ask, "messages": [*history[dropped:], question]}
        ).json()
    assert kept["rag"]["dropped_turns"] == 0 and kept["rag"]["sources"] == rag["sources"]
    assert kept["usage"]["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]
    assert kept["choices"][0]["message"] == reply.json()["choices"][0]["message"]
