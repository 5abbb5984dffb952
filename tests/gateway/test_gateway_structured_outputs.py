"""response_format through real processes over the bundled SmolLM2, with the openai client:
answers that validate against their JSON schema, streamed and not, on both OpenAI routes and
/v1/query; a schema the library cannot compile is a 400 naming the problem."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests import real_model
from tests.gateway.conftest import Spawn
from tests.json_schemas import COLOR, PERSON, SHORT_STRINGS
from tests.service_process import Service

smollm2_dir = real_model.smollm2_dir

QUESTIONS = {
    "person": ("Describe Ada Lovelace, who died at 36, as JSON.", PERSON),
    "enum": ("What colour is the sky on a clear day? Answer as JSON.", COLOR),
    "array": ("Name three fruits as a JSON array.", SHORT_STRINGS),
}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2_gateway(services: Spawn, spawn_gateway: Spawn, smollm2_dir, tmp_path_factory):
    """A gateway over an engine of SmolLM2 (the session's retriever)."""
    engine: Service = services(
        "engine",
        "--model",
        str(smollm2_dir),
        "--store-path",
        str(tmp_path_factory.mktemp("kv-smollm2")),
        "--max-num-seqs",
        "2",
    )
    return spawn_gateway(engine, args=("--ttft-timeout-s", "300"))


@pytest.fixture
def openai_client(gateway, documents):
    """The openai client of the tiny model's gateway: for what fails before any decoding."""
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def smollm2_client(smollm2_gateway):
    return OpenAI(
        base_url=f"{smollm2_gateway.url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def json_schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("kind", sorted(QUESTIONS))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_answers_validate_against_their_schema(smollm2_client, kind, stream):
    question, schema = QUESTIONS[kind]
    arguments = dict(
        model="ragblend",
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=json_schema_format(schema),
        extra_body={"rag": {"top_k": 1}},
    )
    if stream:
        chunks = list(smollm2_client.chat.completions.create(stream=True, **arguments))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = smollm2_client.chat.completions.create(**arguments)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completions_in_json_object_mode_answer_a_json_object(smollm2_client, stream):
    arguments = dict(
        model="ragblend",
        prompt="Describe a cat as a JSON object.",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}, "rag": {"top_k": 1}},
    )
    if stream:
        chunks = [c for c in smollm2_client.completions.create(stream=True, **arguments)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = smollm2_client.completions.create(**arguments)
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    # Any object has no bound: one may run to max_tokens, and is then a JSON object's start.
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and text.startswith("{"), text


def test_query_takes_a_response_format(smollm2_gateway):
    question, schema = QUESTIONS["enum"]
    response = httpx.post(
        f"{smollm2_gateway.url}/v1/query",
        json={
            "question": question,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "top_k": 1,
            "response_format": json_schema_format(schema),
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["answer"]), schema)


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_problem(openai_client):
    schema = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model="ragblend",
            messages=[{"role": "user", "content": "Kessa pass?"}],
            max_tokens=2,
            response_format=json_schema_format(schema),
        )
    assert "response_format" in caught.value.message
    assert "Invalid type: integr" in caught.value.message


def test_the_engine_answers_a_schema_it_cannot_compile_with_a_400_naming_it(engine):
    body = {
        "question": "Kessa pass?",
        "max_tokens": 2,
        "response_format": json_schema_format({"$ref": "#/definitions/missing"}),
    }
    response = httpx.post(f"{engine.url}/v1/generate", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "does not exist" in response.json()["detail"]


@pytest.mark.parametrize(
    ("response_format", "problem"),
    [
        ({"type": "json_schema"}, "json_schema is given with type 'json_schema'"),
        ({"type": "json_object", "json_schema": {"name": "a", "schema": {}}}, "json_schema is"),
        ({"type": "yaml"}, "response_format.type"),
        (json_schema_format({"description": "x" * 70_000}), "above the limit of 65536"),
    ],
)
def test_a_malformed_or_oversized_response_format_is_a_422_naming_it(
    client, response_format, problem
):
    body = {
        "messages": [{"role": "user", "content": "Kessa pass?"}],
        "max_tokens": 2,
        "response_format": response_format,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert problem in response.text
