"""The wire contract: what the gateway accepts from a client, the engine and the retriever
accept from the gateway, at each limit and one past it; a limit changed in the contract reaches
both sides; what the gateway sends is what the engine takes."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import pytest
from pydantic import ValidationError

from common.contract import (
    AUTO_RATIO,
    MAX_COLLECTIONS,
    MAX_DOC_IDS,
    MAX_JSON_SCHEMA_BYTES,
    MAX_QUESTION_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChunkOrder,
    ChunkOrderName,
    GenerateBody,
    Mode,
    SearchRequest,
    Selection,
)
from engine.api.schemas import to_request
from gateway.api.conversation import conversation
from gateway.api.schemas.openai import MAX_MESSAGES, ChatCompletionRequest, RagOptions
from gateway.api.schemas.query import QueryRequest
from gateway.types import EngineRequest, RagRequest, Source
from tests.service_process import REPO_ROOT

# Run in a fresh interpreter: the contract's source with one limit line changed, then each
# side's validation of a stop string of `limit` and of `limit + 1` characters.
CHANGED_LIMIT = """
import importlib.util, json, re, sys
limit = int(sys.argv[1])
spec = importlib.util.find_spec("common.contract")
source, changed = re.subn(
    r"^MAX_STOP_CHARS = .*$", f"MAX_STOP_CHARS = {limit}", open(spec.origin).read(), flags=re.M
)
assert changed == 1, "the contract declares MAX_STOP_CHARS once"
contract = importlib.util.module_from_spec(spec)
sys.modules["common.contract"] = contract
exec(compile(source, spec.origin, "exec"), contract.__dict__)

from pydantic import ValidationError
from engine.api.schemas import to_request
from gateway.api.schemas.openai import CompletionRequest
from gateway.api.schemas.query import QueryRequest
from common.contract import GenerateBody

sides = {
    "gateway query": lambda stop: QueryRequest(question="q", stop=[stop]),
    "gateway completions": lambda stop: CompletionRequest(prompt="q", stop=stop),
    "engine": lambda stop: to_request(GenerateBody(question="q", stop=[stop])),
}
def accepts(make, stop):
    try:
        make(stop)
    except ValidationError:
        return False
    return True
print(json.dumps({
    name: [accepts(make, "s" * limit), accepts(make, "s" * (limit + 1))]
    for name, make in sides.items()
}))
"""


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


@pytest.mark.parametrize("limit", [8, MAX_STOP_CHARS * 4])
def test_a_limit_changed_in_the_contract_reaches_the_gateway_and_the_engine(limit):
    run = subprocess.run(
        [sys.executable, "-c", CHANGED_LIMIT, str(limit)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    verdicts = json.loads(run.stdout)
    # [accepts `limit` characters, accepts `limit + 1`] on every side.
    assert verdicts == {
        "gateway query": [True, False],
        "gateway completions": [True, False],
        "engine": [True, False],
    }


def test_the_chunk_order_setting_offers_the_chunk_orders():
    assert set(get_args(ChunkOrderName)) == {order.value for order in ChunkOrder}


def test_the_search_the_gateway_sends_is_the_one_the_retriever_takes():
    rag = RagRequest(question="who?", top_k=4, doc_ids=["d1"], retrieval="bm25", hops=2)
    taken = SearchRequest.model_validate_json(rag.search().model_dump_json())
    assert (taken.query, taken.top_k, taken.doc_ids) == ("who?", 4, ["d1"])
    assert (taken.retrieval, taken.hops, taken.collections) == ("bm25", 2, None)


def test_the_body_the_gateway_sends_is_the_one_the_engine_takes():
    sources = (
        Source("c1", "d1", 0.9, "first chunk", "default"),
        Source("c2", "d1", 0.5, "second chunk", "default"),
        Source("c1", "d1", 0.9, "first chunk", "default"),
    )
    rag = RagRequest(
        question="why?",
        top_k=3,
        mode=Mode.PREFIX_CACHE,
        stop=("\n\n",),
        presence_penalty=0.5,
        chunk_order=ChunkOrder.BEST_LAST,
    )
    request = EngineRequest(rag, sources)
    sent = request.engine_body().model_dump_json()
    taken = GenerateBody.model_validate_json(sent)  # the engine's route, strict
    assert taken.mode is Mode.PREFIX_CACHE and taken.chunk_order is ChunkOrder.BEST_LAST
    assert [c.id for c in taken.chunks] == ["c1", "c2"]
    assert taken.stop == ["\n\n"] and taken.presence_penalty == 0.5
    assert taken.stream and taken.fit_context


def test_the_longest_chat_the_gateway_accepts_is_a_history_the_engine_takes():
    said = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
        for i in range(MAX_MESSAGES - 1)
    ]
    body = ChatCompletionRequest(messages=[{"role": "system", "content": "Be brief."}, *said])
    chat = conversation(body.messages)
    assert chat is not None and chat.question == f"turn {MAX_MESSAGES - 2}"
    rag = RagRequest(question=chat.question, top_k=2, system=chat.system, history=chat.history)
    sent = EngineRequest(rag, ()).engine_body().model_dump_json()
    request = to_request(GenerateBody.model_validate_json(sent))
    assert [(t.role, t.text) for t in request.history] == [(t.role, t.text) for t in chat.history]
    assert len(request.history) == MAX_MESSAGES - 2 and request.question == chat.question


# The blend options each side takes: the gateway's /v1/query body and OpenAI `rag` object, and
# the engine's body (strict, as its route validates it) converted to its request.
BLEND_SIDES = {
    "gateway query": lambda options: QueryRequest(question="q", **options),
    "gateway rag": lambda options: RagOptions(**options),
    "engine": lambda options: to_request(GenerateBody.model_validate({"question": "q", **options})),
}


@pytest.mark.parametrize(
    "options",
    [
        *({"selection": s.value} for s in Selection),
        {"recompute_ratio": AUTO_RATIO},
        {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 0.0},
        {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 1.0, "selection": "sink"},
        {"recompute_ratio": 0.0},
        {"recompute_ratio": 1.0},
    ],
)
@pytest.mark.parametrize("side", sorted(BLEND_SIDES))
def test_blend_options_the_gateway_accepts_the_engine_accepts(side, options):
    taken = BLEND_SIDES[side](options)
    for name, value in options.items():
        assert getattr(taken, name) == value


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"selection": "best"}, "selection"),
        ({"selection": "oracle"}, "selection"),  # the research runs' own, not a request's
        ({"recompute_ratio": "fast"}, "recompute_ratio"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": float("nan")}, "recompute_ratio"),
        ({"max_recompute_ratio": 0.3}, "max_recompute_ratio"),
        ({"recompute_ratio": 0.2, "max_recompute_ratio": 0.3}, "max_recompute_ratio"),
        ({"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": -0.1}, "max_recompute_ratio"),
    ],
)
@pytest.mark.parametrize("side", sorted(BLEND_SIDES))
def test_blend_options_the_gateway_refuses_the_engine_refuses(side, options, field):
    with pytest.raises(ValidationError) as refused:
        BLEND_SIDES[side](options)
    # Named by the error's location, or (a model validator's) by its message.
    assert all(field in f"{e['loc']} {e['msg']}" for e in refused.value.errors())


def test_the_blend_options_the_gateway_sends_are_those_the_engine_takes():
    rag = RagRequest(
        question="why?",
        top_k=3,
        recompute_ratio=AUTO_RATIO,
        max_recompute_ratio=0.25,
        selection=Selection.SINK,
    )
    sent = EngineRequest(rag, ()).engine_body().model_dump_json()
    taken = to_request(GenerateBody.model_validate_json(sent))
    assert (taken.recompute_ratio, taken.max_recompute_ratio) == (AUTO_RATIO, 0.25)
    assert taken.selection is Selection.SINK
    unset = to_request(
        GenerateBody.model_validate_json(
            EngineRequest(RagRequest(question="why?", top_k=3), ()).engine_body().model_dump_json()
        )
    )
    assert (unset.recompute_ratio, unset.max_recompute_ratio, unset.selection) == (None,) * 3


def test_the_response_format_the_gateway_sends_is_the_one_the_engine_takes():
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    body = QueryRequest(
        question="q",
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert body.response_format is not None
    rag = RagRequest(question="q", top_k=1, response_format=body.response_format)
    sent = EngineRequest(rag, ()).engine_body().model_dump_json()
    assert '"schema":' in sent  # OpenAI's name on the wire, not the field's
    request = to_request(GenerateBody.model_validate_json(sent))  # strict, as the engine's route
    assert request.json_schema is not None and json.loads(request.json_schema) == schema
    json_object = GenerateBody.model_validate(
        {"question": "q", "response_format": {"type": "json_object"}}
    )
    assert to_request(json_object).json_schema == '{"type":"object"}'
    text = GenerateBody.model_validate({"question": "q", "response_format": {"type": "text"}})
    assert to_request(text).json_schema is None


def schema_of_bytes(size: int) -> dict:
    """A schema whose canonical serialization is `size` bytes long."""
    padding = size - len(json.dumps({"description": ""}, separators=(",", ":")))
    return {"description": "x" * padding}


@pytest.mark.parametrize("side", ["gateway", "engine"])
def test_a_schema_at_the_size_limit_passes_and_one_byte_more_is_refused_on_both_sides(side):
    def make(schema: dict) -> object:
        response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        if side == "gateway":
            return QueryRequest(question="q", response_format=response_format)
        return GenerateBody.model_validate({"question": "q", "response_format": response_format})

    make(schema_of_bytes(MAX_JSON_SCHEMA_BYTES))
    with pytest.raises(ValidationError, match="above the limit"):
        make(schema_of_bytes(MAX_JSON_SCHEMA_BYTES + 1))
