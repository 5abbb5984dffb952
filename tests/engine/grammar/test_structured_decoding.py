"""The bundled SmolLM2 decoding under JSON schemas in one batch beside a free-text sequence:
each output validates against its own schema and ends with "stop", the free one is what it is
alone, and the blend (the prefill) is the same with or without a schema."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine.engine import Engine
from engine.types import Chunk, GenerateRequest, GenerateResult, Mode
from tests import real_model
from tests.json_schemas import COLOR, PERSON, SHORT_STRINGS

smollm2_dir = real_model.smollm2_dir

CHUNKS = (
    Chunk("a", "Ada Lovelace was born in London in 1815 and died at the age of 36."),
    Chunk("b", "The sky over the harbour was green at dawn, the sailors said."),
)


def ask(question: str, schema: dict | None = None, mode: Mode = Mode.CACHEBLEND) -> GenerateRequest:
    return GenerateRequest(
        question=question,
        chunks=CHUNKS,
        mode=mode,
        max_tokens=64,
        temperature=0.0,
        json_schema=None if schema is None else json.dumps(schema),
    )


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    engine = Engine.from_pretrained(str(smollm2_dir), max_num_seqs=4)
    yield engine
    engine.close()


def together(engine: Engine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """The requests queued at once, so that they decode as one batch."""

    async def run(request: GenerateRequest) -> GenerateResult:
        async for event in engine.start(request):
            if isinstance(event, GenerateResult):
                return event
        raise AssertionError("no result")

    async def gather() -> list[GenerateResult]:
        return list(await asyncio.gather(*(run(r) for r in requests)))

    return asyncio.run(gather())


def test_sequences_with_and_without_a_schema_decode_together_each_by_its_own(engine):
    # Full prefill: the prompts' KV is the same alone and together whatever the store holds.
    full = Mode.FULL_PREFILL
    requests = [
        ask("Who was Ada Lovelace? Answer as JSON with her name and age.", PERSON, full),
        ask("Which colour was the sky? Answer as JSON.", COLOR, full),
        ask("Who was Ada Lovelace?", None, full),
        ask("List the cities named in the passages as a JSON array.", SHORT_STRINGS, full),
    ]
    results = together(engine, requests)
    for result, schema in zip(results, (PERSON, COLOR, None, SHORT_STRINGS), strict=True):
        if schema is None:
            continue
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), schema)
    alone = engine.generate(requests[2])
    assert results[2].token_ids == alone.token_ids
    assert not results[2].text.lstrip().startswith("{")  # the free one was not constrained


def test_a_schema_changes_the_decoding_only_not_the_blend(engine):
    engine.generate(ask("Who was Ada Lovelace?"))
    engine.drain()  # the chunks' KV is stored: both prompts below blend it alike
    free = engine.generate(ask("Who was Ada Lovelace?"))
    shaped = engine.generate(ask("Who was Ada Lovelace?", PERSON))
    assert shaped.usage.prompt_tokens == free.usage.prompt_tokens
    assert shaped.usage.recomputed_tokens == free.usage.recomputed_tokens
    assert shaped.blend == free.blend
    jsonschema.validate(json.loads(shaped.text), PERSON)
