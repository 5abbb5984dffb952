"""Bodies of POST /v1/query: the RAG question in, the answer with its sources out."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.limits import (
    MAX_COLLECTIONS,
    MAX_DOC_IDS,
    MAX_HOPS,
    MAX_QUESTION_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)
from common.validation import CollectionName, DocId, Seed, Text
from gateway.types import ChunkOrderName, EngineResult, Source

ModeName = Literal["cacheblend", "full_prefill", "prefix_cache", "full_reuse"]
# The retriever's search modes (docs/retriever.md, "Hybrid retrieval"); None: its default.
RetrievalName = Literal["dense", "bm25", "hybrid"]
RETRIEVAL_DESCRIPTION = "dense, bm25 or hybrid; default: the retriever's `retrieval` setting"
HOPS_DESCRIPTION = (
    "2: add up to top_k chunks found by the names the first ones mention; "
    "default: the gateway's default_hops setting"
)
CHUNK_ORDER_DESCRIPTION = (
    "best_first: the best chunk first in the prompt; best_last: next to the question; "
    "default: the gateway's chunk_order setting"
)
# Bounds of what a client may send: common.limits, shared with the retriever and the engine
# (the body size limit bounds the rest).
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
DocIds = Annotated[list[DocId], Field(min_length=1, max_length=MAX_DOC_IDS)]
Collections = Annotated[list[CollectionName], Field(min_length=1, max_length=MAX_COLLECTIONS)]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
# OpenAI's range; vLLM's repetition_penalty (1: off), bounded like the engine's.
AdditivePenalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=2, allow_inf_nan=False)]
PENALTY_DESCRIPTION = (
    "default: the engine's setting of the same name (neutral but for the bundled model)"
)


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: Text = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    # Upper bounds of top_k and max_tokens are settings, checked in the route.
    top_k: int | None = Field(None, ge=1, description="default: the gateway's default_top_k")
    mode: ModeName = "cacheblend"
    recompute_ratio: Ratio | None = Field(None, description="None: the controller")
    max_tokens: int | None = Field(None, ge=1, description="default: default_max_tokens")
    temperature: float = Field(0.0, ge=0, le=10, allow_inf_nan=False)
    top_p: TopP = 1.0
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    frequency_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    repetition_penalty: RepetitionPenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    stop: list[StopText] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    doc_ids: DocIds | None = Field(None, description="search only these")
    collections: Collections | None = Field(
        None, description="search only these (default: all the API key may use)"
    )
    retrieval: RetrievalName | None = Field(None, description=RETRIEVAL_DESCRIPTION)
    hops: int | None = Field(None, ge=1, le=MAX_HOPS, description=HOPS_DESCRIPTION)
    chunk_order: ChunkOrderName | None = Field(None, description=CHUNK_ORDER_DESCRIPTION)

    _question_not_blank = field_validator("question")(not_blank)


class SourceOut(BaseModel):
    chunk_id: str
    doc_id: str
    collection: str | None
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


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    recomputed_tokens: int


class TimingsOut(BaseModel):
    retrieval_s: float
    ttft_s: float | None = Field(description="request arrival to first token, at the gateway")
    total_s: float
    engine: dict[str, Any] = Field(description="the engine's own timings (ttft_s, kv_load_s…)")


class QueryResponse(BaseModel):
    answer: str
    finish_reason: str
    mode: ModeName
    sources: list[SourceOut] = Field(description="the sources in the prompt, best first")
    dropped_sources: int = Field(
        description="retrieved sources left out (the worst) so that the prompt fit the model"
    )
    usage: UsageOut
    timings: TimingsOut
    blend: dict[str, Any]
    engine: str = Field(description="name of the engine that answered (engine-0, engine-1…)")
    chunk_tiers: list[str | None] = Field(description="per chunk, where its KV came from")
    request_id: str

    @classmethod
    def of(
        cls,
        outcome: EngineResult,
        mode: str,
        used_sources: list[Source],
        *,
        retrieval_s: float,
        ttft_s: float | None,
        total_s: float,
        request_id: str,
    ) -> QueryResponse:
        engine_timings = {k: v for k, v in outcome.timings.items() if k != "layers"}
        return cls(
            answer=outcome.text,
            finish_reason=outcome.finish_reason,
            mode=mode,
            sources=[SourceOut.of(s) for s in used_sources],
            dropped_sources=outcome.dropped_chunks,
            usage=UsageOut(**outcome.usage),
            timings=TimingsOut(
                retrieval_s=retrieval_s, ttft_s=ttft_s, total_s=total_s, engine=engine_timings
            ),
            blend=outcome.blend,
            engine=outcome.engine,
            chunk_tiers=outcome.chunk_tiers,
            request_id=request_id,
        )
