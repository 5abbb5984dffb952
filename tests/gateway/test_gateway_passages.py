"""Passages the application sends (rag.documents, /v1/query's documents, LMCache's separator):
chunked like ingested documents, blended like retrieved chunks, their KV reused in another
order; retrieval "none" searches nothing; limits are 422s naming the field; LangChain's
ChatOpenAI sends them in extra_body."""

from __future__ import annotations

import uuid

import httpx
import pytest

from common.contract import MAX_CACHE_SALT_CHARS, MAX_PASSAGE_CHARS, MAX_PASSAGES
from tests.gateway.gateway_testutil import metric_value

PASSAGES = [
    {"id": "harbour", "text": "The harbour of Telvani shelters red boats with seven masts."},
    {"id": "bells", "text": "Bells of the Orrim tower ring twice at dusk for the ferry."},
    {"id": "salt", "text": "Salt from the Vessa flats is traded for amber in Telvani."},
]
QUESTION = "What is traded for amber in Telvani?"
SEARCHES = "ragblend_retriever_search_latency_seconds_count"


def searches(retriever) -> float:
    return metric_value(httpx.get(f"{retriever.url}/metrics", timeout=10).text, SEARCHES)


def doc_ids(answer: dict) -> list[str]:
    """The passages of the answer's sources, in order (a passage may span several chunks)."""
    return list(dict.fromkeys(s["doc_id"] for s in answer["sources"]))


def texts(sources: list[dict]) -> list[str]:
    """Each passage's text, its chunks joined (a chunk is a substring: spaces between go)."""
    joined: dict[str, str] = {}
    for source in sources:
        joined[source["doc_id"]] = joined.get(source["doc_id"], "") + source["text"]
    return [t.replace(" ", "") for t in joined.values()]


def ask(client: httpx.Client, documents: list[dict] | None, salt: str, **rag) -> dict:
    body = {
        "question": QUESTION,
        "documents": documents,
        "retrieval": "none",
        "cache_salt": salt,
        "max_tokens": 4,
        "temperature": 0,
        **rag,
    }
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_passages_in_another_order_reuse_their_kv_and_match_full_prefill_at_ratio_one(
    client, retriever
):
    salt = uuid.uuid4().hex  # nothing cached under it yet, the prompt prefix included
    before = searches(retriever)
    first = ask(client, PASSAGES, salt)
    assert doc_ids(first) == ["harbour", "bells", "salt"]
    assert {s["collection"] for s in first["sources"]} == {""}
    assert first["usage"]["cached_tokens"] == 0
    assert set(first["chunk_tiers"]) == {None}

    reordered = [PASSAGES[2], PASSAGES[0], PASSAGES[1]]
    again = None
    for _ in range(50):  # the first request's write-back runs behind it
        again = ask(client, reordered, salt, recompute_ratio=1.0)
        if None not in again["chunk_tiers"]:
            break
    assert again is not None and None not in again["chunk_tiers"], again
    assert again["usage"]["cached_tokens"] > 0
    full = ask(client, reordered, salt, mode="full_prefill")
    assert again["answer"] == full["answer"]
    assert searches(retriever) == before, "retrieval none searched"


def test_retrieval_none_without_documents_is_the_question_alone(client, retriever):
    before = searches(retriever)
    answer = ask(client, None, "")
    assert answer["sources"] == [] and searches(retriever) == before


def test_documents_come_before_what_the_search_finds(client):
    body = {
        "messages": [{"role": "user", "content": "Where does the Zorblax river flow?"}],
        "max_tokens": 2,
        "rag": {"documents": [{"text": PASSAGES[0]["text"]}], "top_k": 1},
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    sources = response.json()["rag"]["sources"]
    assert sources[0]["doc_id"] == "passage-0" and sources[0]["collection"] == ""
    assert sources[-1]["collection"] == "default"
    assert [s["collection"] for s in sources].count("default") == 1


def test_a_long_passage_is_chunked_like_an_ingested_document(client):
    # Well above the retriever's chunk_tokens, below the model's positions.
    text = " ".join(f"Keeper {i} of Orrim counts {i} gulls." for i in range(8))
    long = {"id": "long", "text": text}
    answer = ask(client, [long], uuid.uuid4().hex, max_tokens=1)
    assert answer["dropped_sources"] == 0
    assert len(answer["sources"]) > 1 and doc_ids(answer) == ["long"]
    assert texts(answer["sources"]) == [long["text"].replace(" ", "")]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/query", {"documents": [{"text": "x"}] * (MAX_PASSAGES + 1)}, "documents"),
        ("/v1/query", {"documents": [{"text": "x" * (MAX_PASSAGE_CHARS + 1)}]}, "text"),
        ("/v1/query", {"documents": [{"text": "   "}]}, "text"),
        ("/v1/query", {"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
        ("/v1/query", {"retrieval": "nothing"}, "retrieval"),
        (
            "/v1/chat/completions",
            {"rag": {"documents": [{"text": "x"}] * (MAX_PASSAGES + 1)}},
            "documents",
        ),
        (
            "/v1/chat/completions",
            {"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)},
            "cache_salt",
        ),
    ],
)
def test_passages_beyond_the_limits_are_a_422_naming_the_field(client, path, body, field):
    base = (
        {"question": QUESTION}
        if path == "/v1/query"
        else {"messages": [{"role": "user", "content": QUESTION}]}
    )
    response = client.post(path, json={**base, **body})
    assert response.status_code == 422, response.text
    assert field in response.text


@pytest.fixture(scope="module")
def lmcache_gateway(spawn_gateway, engine):
    return spawn_gateway(engine, args=("--passage-separator", " # # "))


def test_lmcache_separator_splits_a_plain_prompt_into_system_passages_and_question(
    lmcache_gateway, retriever
):
    prompt = " # # ".join(
        ["You answer briefly.", PASSAGES[0]["text"], PASSAGES[2]["text"], QUESTION]
    )
    before = searches(retriever)
    with httpx.Client(base_url=lmcache_gateway.url, timeout=120) as http:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200, response.text
    sources = response.json()["rag"]["sources"]
    assert list(dict.fromkeys(s["doc_id"] for s in sources)) == ["passage-0", "passage-1"]
    assert texts(sources) == [PASSAGES[i]["text"].replace(" ", "") for i in (0, 2)]
    assert searches(retriever) == before, "a prompt in LMCache's convention searched"


def test_langchain_chat_openai_sends_passages_in_extra_body(gateway, documents):
    from langchain_openai import ChatOpenAI

    rag = {"documents": PASSAGES, "retrieval": "none"}
    llm = ChatOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="ragblend",
        max_tokens=4,
        temperature=0,
        extra_body={"rag": rag, "cache_salt": uuid.uuid4().hex},
    )
    first = llm.invoke(QUESTION)
    assert isinstance(first.content, str)
    assert first.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = 0
    for _ in range(50):  # the first call's write-back runs behind it
        usage = llm.invoke(QUESTION).response_metadata["token_usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if cached:
            break
    assert cached > 0


def test_a_split_prompt_beyond_the_passage_limits_is_a_422(lmcache_gateway):
    too_many = " # # ".join(["sys"] + ["p"] * (MAX_PASSAGES + 1) + [QUESTION])
    with httpx.Client(base_url=lmcache_gateway.url, timeout=120) as http:
        response = http.post("/v1/completions", json={"prompt": too_many, "max_tokens": 1})
    assert response.status_code == 422, response.text
    assert "passages" in response.text
