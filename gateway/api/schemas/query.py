"""Bodies of POST /v1/query: the RAG question in, the answer with its sources out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.contract import (
    MAX_HISTORY_TURNS,
    MAX_QUESTION_CHARS,
    AdditivePenalty,
    Blend,
    CacheSalt,
    ChunkOrder,
    Collections,
    DocIds,
    Hops,
    Mode,
    Passages,
    Ratio,
    RecomputeRatio,
    RepetitionPenalty,
    RequestRetrievalName,
    ResponseFormat,
    Selection,
    Stops,
    Temperature,
    TopP,
    TurnRole,
    Usage,
    history_error,
    max_ratio_needs_auto,
    not_blank,
)
from common.validation import Seed, Text
from gateway.types import EngineResult, Source

RETRIEVAL_DESCRIPTION = (
    "dense, bm25 or hybrid; none: no search (the request's documents only); default: the "
    "retriever's `retrieval` setting"
)
DOCUMENTS_DESCRIPTION = (
    "the application's own passages, chunked like an ingested document and blended like "
    "retrieved chunks (before them, in the order given); their KV is cached per tenant"
)
CACHE_SALT_DESCRIPTION = (
    "as vLLM's: the request's passages and prompt prefix reuse only KV cached under the same "
    "salt (and the same API key's scope); retrieved chunks keep their collection's"
)
HOPS_DESCRIPTION = (
    "2: add up to top_k chunks found by the names the first ones mention; "
    "default: the gateway's default_hops setting"
)
CHUNK_ORDER_DESCRIPTION = (
    "best_first: the best chunk first in the prompt; best_last: next to the question; "
    "default: the gateway's chunk_order setting"
)
RESPONSE_FORMAT_DESCRIPTION = (
    "OpenAI's: text; json_object (any JSON object); json_schema (JSON valid against its "
    "schema, enforced whatever `strict` says); a schema that does not compile is a 400"
)
RECOMPUTE_RATIO_DESCRIPTION = (
    "share of the chunk tokens cacheblend recomputes, or auto: the check layer chooses it "
    "(at most max_recompute_ratio); default: the engine's recompute_ratio setting (the "
    "controller unless set)"
)
MAX_RECOMPUTE_RATIO_DESCRIPTION = (
    "the largest ratio auto may choose, with recompute_ratio auto only; default: the engine's "
    "auto_max_ratio setting"
)
SELECTION_DESCRIPTION = (
    "how cacheblend picks the tokens it recomputes (hkvd, sink, query…; random is a baseline); "
    "default: the engine's selection setting; see docs/quality.md#token-selection"
)
PENALTY_DESCRIPTION = (
    "default: the engine's setting of the same name, else the model's generation_config, "
    "else neutral"
)
SAMPLING_DEFAULT_DESCRIPTION = (
    "default: the engine's setting of the same name, else the model's generation_config, "
    "else greedy decoding (temperature 0, top_p 1)"
)


class QueryTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: TurnRole
    text: Text = Field(min_length=1, max_length=MAX_QUESTION_CHARS)

    _text_not_blank = field_validator("text")(not_blank)


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: Text = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    history: list[QueryTurn] = Field(
        default_factory=list,
        max_length=MAX_HISTORY_TURNS,
        description="the conversation before the question, oldest first: user and assistant "
        "alternating, from a user turn to an assistant turn; the oldest dropped first when the "
        "prompt does not fit",
    )
    # Upper bounds of top_k and max_tokens are settings, checked in the route.
    top_k: int | None = Field(None, ge=1, description="default: the gateway's default_top_k")
    mode: Mode = Mode.CACHEBLEND
    recompute_ratio: RecomputeRatio | None = Field(None, description=RECOMPUTE_RATIO_DESCRIPTION)
    max_recompute_ratio: Ratio | None = Field(None, description=MAX_RECOMPUTE_RATIO_DESCRIPTION)
    selection: Selection | None = Field(None, description=SELECTION_DESCRIPTION)
    max_tokens: int | None = Field(None, ge=1, description="default: default_max_tokens")
    temperature: Temperature | None = Field(None, description=SAMPLING_DEFAULT_DESCRIPTION)
    top_p: TopP | None = Field(None, description=SAMPLING_DEFAULT_DESCRIPTION)
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    frequency_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    repetition_penalty: RepetitionPenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    stop: Stops | None = None
    stream: bool = False
    doc_ids: DocIds | None = Field(None, description="search only these")
    collections: Collections | None = Field(
        None, description="search only these (default: all the API key may use)"
    )
    retrieval: RequestRetrievalName | None = Field(None, description=RETRIEVAL_DESCRIPTION)
    hops: Hops | None = Field(None, description=HOPS_DESCRIPTION)
    chunk_order: ChunkOrder | None = Field(None, description=CHUNK_ORDER_DESCRIPTION)
    response_format: ResponseFormat | None = Field(None, description=RESPONSE_FORMAT_DESCRIPTION)
    documents: Passages | None = Field(None, description=DOCUMENTS_DESCRIPTION)
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_DESCRIPTION)

    _question_not_blank = field_validator("question")(not_blank)
    _max_ratio_needs_auto = model_validator(mode="after")(max_ratio_needs_auto)

    @field_validator("history")
    @classmethod
    def _history_alternates(cls, history: list[QueryTurn]) -> list[QueryTurn]:
        error = history_error([turn.role for turn in history])
        if error is not None:
            raise ValueError(error)
        return history


class SourceOut(BaseModel):
    chunk_id: str
    doc_id: str
    collection: str
    score: float
    text: str

    @classmethod
    def of(cls, source: Source) -> SourceOut:
        return cls(
            chunk_id=source.chunk_id,
            doc_id=source.doc_id,
            collection=source.collection,
            score=source.score,
            text=source.text,
        )


class TimingsOut(BaseModel):
    retrieval_s: float
    ttft_s: float | None = Field(description="request arrival to first token, at the gateway")
    total_s: float
    engine: dict[str, Any] = Field(description="the engine's own timings (ttft_s, kv_load_s…)")


class QueryResponse(BaseModel):
    answer: str
    finish_reason: str
    mode: Mode
    sources: list[SourceOut] = Field(description="the sources in the prompt, best first")
    dropped_sources: int = Field(
        description="retrieved sources left out (the worst) so that the prompt fit the model"
    )
    dropped_turns: int = Field(
        description="turns of history left out (the oldest) so that the prompt fit the model"
    )
    usage: Usage
    timings: TimingsOut
    blend: Blend
    engine: str = Field(description="name of the engine that answered (engine-0, engine-1…)")
    chunk_tiers: list[str | None] = Field(description="per chunk, where its KV came from")
    request_id: str

    @classmethod
    def of(
        cls,
        outcome: EngineResult,
        mode: Mode,
        used_sources: list[Source],
        *,
        retrieval_s: float,
        ttft_s: float | None,
        total_s: float,
        request_id: str,
    ) -> QueryResponse:
        engine_timings = outcome.timings.model_dump(exclude={"layers"})
        return cls(
            answer=outcome.text,
            finish_reason=outcome.finish_reason,
            mode=mode,
            sources=[SourceOut.of(s) for s in used_sources],
            dropped_sources=outcome.dropped_chunks,
            dropped_turns=outcome.dropped_turns,
            usage=outcome.usage,
            timings=TimingsOut(
                retrieval_s=retrieval_s, ttft_s=ttft_s, total_s=total_s, engine=engine_timings
            ),
            blend=outcome.blend,
            engine=outcome.engine,
            chunk_tiers=outcome.chunk_tiers,
            request_id=request_id,
        )
