"""One set of limits for the wire contract: what the gateway accepts from a client, the engine
and the retriever accept from the gateway, at each limit and one past it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.limits import (
    MAX_COLLECTIONS,
    MAX_DOC_IDS,
    MAX_QUESTION_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)
from engine.api.schemas import GenerateBody
from gateway.api.schemas.query import QueryRequest
from retriever.api.schemas import SearchRequest


def stops(count: int, chars: int) -> list[str]:
    return ["s" * chars] * count


@pytest.mark.parametrize(
    ("count", "chars"), [(MAX_STOP_STRINGS, MAX_STOP_CHARS), (1, MAX_STOP_CHARS)]
)
def test_stop_strings_the_gateway_accepts_the_engine_accepts(count, chars):
    QueryRequest(question="q", stop=stops(count, chars))
    GenerateBody(question="q", stop=stops(count, chars))


@pytest.mark.parametrize(("count", "chars"), [(MAX_STOP_STRINGS + 1, 1), (1, MAX_STOP_CHARS + 1)])
def test_stop_strings_past_the_limit_are_refused_by_the_gateway_and_the_engine(count, chars):
    with pytest.raises(ValidationError):
        QueryRequest(question="q", stop=stops(count, chars))
    with pytest.raises(ValidationError):
        GenerateBody(question="q", stop=stops(count, chars))


def test_a_search_the_gateway_accepts_the_retriever_accepts():
    question = "q" * MAX_QUESTION_CHARS
    doc_ids, collections = [f"d{i}" for i in range(MAX_DOC_IDS)], [f"c{i}" for i in range(64)]
    assert len(collections) == MAX_COLLECTIONS
    QueryRequest(question=question, doc_ids=doc_ids, collections=collections)
    SearchRequest(query=question, doc_ids=doc_ids, collections=collections)
    with pytest.raises(ValidationError):
        SearchRequest(query=question + "q")
    with pytest.raises(ValidationError):
        QueryRequest(question=question + "q")
