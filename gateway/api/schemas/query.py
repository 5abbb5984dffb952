"""Bodies of POST /v1/query: the RAG question in, the answer with its sources out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.types import EngineResult, Source

ModeName = Literal["cacheblend", "full_prefill", "prefix_cache", "full_reuse"]


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=100_000)
    # Upper bounds of top_k and max_tokens are settings, checked in the route.
    top_k: int | None = Field(None, ge=1, description="default: the gateway's default_top_k")
    mode: ModeName = "cacheblend"
    recompute_ratio: float | None = Field(None, ge=0, le=1, description="None: the controller")
    max_tokens: int | None = Field(None, ge=1, description="default: default_max_tokens")
    temperature: float = Field(0.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    doc_ids: list[str] | None = Field(None, min_length=1, description="search only these")

    _question_not_blank = field_validator("question")(not_blank)


class SourceOut(BaseModel):
    chunk_id: str
    doc_id: str
    score: float
    text: str

    @classmethod
    def of(cls, source: Source) -> SourceOut:
        return cls(
            chunk_id=source.chunk_id, doc_id=source.doc_id, score=source.score, text=source.text
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
    sources: list[SourceOut]
    usage: UsageOut
    timings: TimingsOut
    blend: dict[str, Any]
    engine: str = Field(description="URL of the engine that answered")
    chunk_tiers: list[str | None] = Field(description="per chunk, where its KV came from")
    request_id: str

    @classmethod
    def of(
        cls,
        outcome: EngineResult,
        mode: str,
        sources: list[Source],
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
            sources=[SourceOut.of(s) for s in sources],
            usage=UsageOut(**outcome.usage),
            timings=TimingsOut(
                retrieval_s=retrieval_s, ttft_s=ttft_s, total_s=total_s, engine=engine_timings
            ),
            blend=outcome.blend,
            engine=outcome.engine_url,
            chunk_tiers=outcome.chunk_tiers,
            request_id=request_id,
        )
