"""One RagRequest for every generating route: /v1/query and the OpenAI bodies resolve their
defaults (settings, the API key's collections) and setting limits the same way."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from common.contract import ChunkOrder, Mode
from gateway.api.rag import query_rag_request, rag_request
from gateway.api.schemas.openai import ChatCompletionRequest
from gateway.api.schemas.query import QueryRequest
from gateway.auth import ApiKey
from gateway.settings import GatewaySettings

SETTINGS = GatewaySettings(default_top_k=3, default_hops=2, chunk_order="best_last")


def of_query(body: QueryRequest, key: ApiKey | None = None, max_model_len: int | None = None):
    return query_rag_request(body, settings=SETTINGS, key=key, max_model_len=max_model_len)


def test_a_query_without_options_takes_the_settings_defaults():
    rag = of_query(QueryRequest(question="why?"))
    assert (rag.top_k, rag.hops, rag.chunk_order) == (3, 2, ChunkOrder.BEST_LAST)
    assert rag.max_tokens == SETTINGS.default_max_tokens and rag.collections is None
    search = rag.search()
    assert (search.query, search.top_k, search.hops) == ("why?", 3, 2)


def test_a_chat_request_and_a_query_with_the_same_options_make_the_same_request():
    options = {"top_k": 2, "mode": "full_prefill", "hops": 1, "chunk_order": "best_first"}
    query = QueryRequest(question="why?", max_tokens=9, temperature=0.5, stop=["x"], **options)
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "why?"}],
        max_tokens=9,
        temperature=0.5,
        stop="x",
        rag=options,
    )
    from_chat = rag_request(
        "why?",
        None,
        chat.rag,
        chat,
        max_tokens=chat.token_limit,
        stop=chat.stop_list,
        settings=SETTINGS,
        key=None,
        max_model_len=None,
    )
    assert from_chat == of_query(query)
    assert from_chat.mode is Mode.FULL_PREFILL


def test_a_key_limits_the_search_to_its_collections_and_refuses_others():
    key = ApiKey("alice", b"", ("a", "b"))
    assert of_query(QueryRequest(question="q"), key).collections == ["a", "b"]
    with pytest.raises(HTTPException) as refused:
        of_query(QueryRequest(question="q", collections=["c"]), key)
    assert refused.value.status_code == 403


def test_max_tokens_past_the_models_context_is_a_422():
    with pytest.raises(HTTPException) as refused:
        of_query(QueryRequest(question="q", max_tokens=64), max_model_len=64)
    assert refused.value.status_code == 422
