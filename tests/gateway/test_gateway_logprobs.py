"""Logprobs and echo through the OpenAI routes with the official openai client, in OpenAI's
response shapes streamed and not, and the no-rag model id that serves the prompt as sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

NO_RAG = "ragblend-no-rag"
QUESTION = "Where does the Zorblax river flow?"
PROMPT = "The Zorblax river flows north past the old mill"
CHAT = {"messages": [{"role": "user", "content": "Kessa pass?"}], "max_tokens": 2}


@pytest.fixture
def openai_client(gateway, documents):
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def chat(openai_client, **fields):
    return openai_client.chat.completions.create(
        model="ragblend",
        max_tokens=5,
        temperature=0,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"rag": {"mode": "full_prefill"}},
        **fields,
    )


def test_chat_logprobs_come_per_token_with_top_logprobs_streamed_and_not(openai_client):
    reply = chat(openai_client, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    # Each generated token (an EOS that ended it too).
    assert reply.usage.completion_tokens <= len(content) <= reply.usage.completion_tokens + 1
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = [
        item
        for chunk in chat(openai_client, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_chat_without_logprobs_gets_none(openai_client):
    assert chat(openai_client).choices[0].logprobs is None


def test_completion_logprobs_come_in_openais_parallel_lists_streamed_and_not(openai_client):
    fields = {"model": "ragblend", "prompt": QUESTION, "max_tokens": 5, "temperature": 0}
    fields["extra_body"] = {"rag": {"mode": "full_prefill"}}
    reply = openai_client.completions.create(logprobs=2, **fields)
    logprobs = reply.choices[0].logprobs
    count = len(logprobs.tokens)
    assert count >= reply.usage.completion_tokens >= 1
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == count
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(count)]
    entries = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, logprob, top in entries:
        assert top[token] == pytest.approx(logprob) and max(top.values()) == top[token]
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in openai_client.completions.create(logprobs=2, stream=True, **fields):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values.extend(getattr(chunk.choices[0].logprobs, key))
    assert streamed == {
        "tokens": logprobs.tokens,
        "token_logprobs": logprobs.token_logprobs,
        "text_offset": logprobs.text_offset,
    }


def test_echo_gives_the_prompt_tokens_logprobs_of_the_model_forward(openai_client, hf):
    model, tokenizer = hf
    reply = openai_client.completions.create(
        model=NO_RAG, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[: len(prompt_ids)] == [tokenizer.decode([t]) for t in prompt_ids]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for p, logprob in enumerate(logprobs.token_logprobs[1 : len(prompt_ids)], start=1):
        assert logprob == pytest.approx(float(expected[p - 1, prompt_ids[p]]), abs=1e-4)
    generated = int(expected[-1].argmax())
    assert logprobs.token_logprobs[-1] == pytest.approx(float(expected[-1, generated]), abs=1e-4)


def test_echo_streamed_sends_the_prompt_first(openai_client):
    chunks = list(
        openai_client.completions.create(
            model=NO_RAG, prompt=PROMPT, max_tokens=2, logprobs=0, echo=True, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.text_offset[0] == 0
    assert all(lp is not None for lp in first.logprobs.token_logprobs[1:])


def test_a_prompt_of_token_ids_is_served_as_sent_by_the_no_rag_model(openai_client, hf):
    _, tokenizer = hf
    ids = tokenizer(PROMPT)["input_ids"]
    by_ids = openai_client.completions.create(
        model=NO_RAG, prompt=ids, max_tokens=3, temperature=0, logprobs=0, echo=True
    )
    by_text = openai_client.completions.create(
        model=NO_RAG, prompt=[PROMPT], max_tokens=3, temperature=0, logprobs=0, echo=True
    )
    assert by_ids.choices[0].logprobs.tokens == by_text.choices[0].logprobs.tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_the_no_rag_model_does_no_retrieval(openai_client, hf):
    _, tokenizer = hf
    reply = openai_client.completions.create(model=NO_RAG, prompt=QUESTION, max_tokens=2)
    assert reply.model_extra["rag"]["sources"] == []
    # The prompt as sent: its own tokens, no template, system text or chunks.
    assert reply.usage.prompt_tokens == len(tokenizer(QUESTION)["input_ids"])
    answer = openai_client.chat.completions.create(
        model=NO_RAG, max_tokens=2, messages=[{"role": "user", "content": QUESTION}]
    )
    assert answer.model_extra["rag"]["sources"] == []
    rag = openai_client.completions.create(model="ragblend", prompt=QUESTION, max_tokens=2)
    assert rag.model_extra["rag"]["sources"]


@pytest.mark.parametrize(
    ("path", "fields", "named"),
    [
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "Kessa pass?", "logprobs": 21}, "logprobs"),
    ],
)
def test_too_many_top_logprobs_are_a_422_naming_the_field(client, path, fields, named):
    response = client.post(path, json=fields)
    assert response.status_code == 422, response.text
    assert named in response.json()["detail"]


@pytest.mark.parametrize(
    ("fields", "named"), [({"echo": True}, "echo"), ({"prompt": [1, 2, 3]}, "token ids")]
)
def test_echo_and_token_ids_on_the_rag_model_are_a_400_naming_the_no_rag_model(
    client, fields, named
):
    body = {"model": "ragblend", "prompt": "Kessa pass?", "max_tokens": 2, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["detail"] and NO_RAG in response.json()["detail"]


def test_lm_eval_scores_a_continuation_as_transformers_does(client, hf):
    """lm-evaluation-harness's own payload and parser (local-completions,
    docs/benchmarks/lm-eval.md)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tokenizer = hf
    context = tokenizer("The Zorblax river flows")["input_ids"]
    continuation = tokenizer(" north past the mill")["input_ids"]
    harness = SimpleNamespace(model=NO_RAG)  # what its payload builder reads of the instance
    payload = LocalCompletionsAPI._create_payload(harness, [context + continuation])
    assert payload["echo"] is True and payload["prompt"] == [context + continuation]
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    ((score, greedy),) = LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(context)])
    with torch.no_grad():
        logits = model(torch.tensor([context + continuation])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = sum(
        float(logprobs[len(context) + i - 1, token]) for i, token in enumerate(continuation)
    )
    assert score == pytest.approx(expected, abs=1e-4)
    assert greedy == all(
        int(logprobs[len(context) + i - 1].argmax()) == token
        for i, token in enumerate(continuation)
    )
