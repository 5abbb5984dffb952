"""Request and response bodies of the engine service, one model per direction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.types import Chunk, GenerateRequest, GenerateResult, Mode

ModeName = Literal["cacheblend", "full_prefill", "prefix_cache", "full_reuse"]


class ChunkIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)


class PrecomputeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: list[ChunkIn] = Field(max_length=10_000)


class PrecomputeResponse(BaseModel):
    stored: int
    skipped: int
    bytes: int


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system: str | None = None
    chunks: list[ChunkIn] = Field(default_factory=list, max_length=1_000)
    question: str = Field(min_length=1)
    mode: ModeName = "cacheblend"
    recompute_ratio: float | None = Field(None, ge=0, le=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stream: bool = False

    def to_request(self) -> GenerateRequest:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return GenerateRequest(
            question=self.question,
            chunks=tuple(Chunk(c.id, c.text) for c in self.chunks),
            system=self.system,
            mode=Mode(self.mode),
            recompute_ratio=self.recompute_ratio,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
        )


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    recomputed_tokens: int


class LayerOut(BaseModel):
    layer: int
    load_start_s: float | None
    load_end_s: float | None
    compute_start_s: float
    compute_end_s: float


class TimingsOut(BaseModel):
    ttft_s: float
    queue_s: float
    prefill_s: float
    kv_load_s: float
    kv_wait_s: float
    recompute_s: float
    decode_s: float
    total_s: float
    overlap: float
    layers: list[LayerOut]


class BlendOut(BaseModel):
    recompute_ratio: float
    leading_layers: int
    chosen_by: str
    fell_back_to_full_prefill: bool


class GenerateResponse(BaseModel):
    text: str
    finish_reason: str
    usage: UsageOut
    timings: TimingsOut
    blend: BlendOut
    chunk_tiers: list[str | None]

    @classmethod
    def from_result(cls, result: GenerateResult) -> GenerateResponse:
        return cls(
            text=result.text,
            finish_reason=result.finish_reason,
            usage=UsageOut(**vars(result.usage)),
            timings=TimingsOut(
                **vars(result.timings), layers=[LayerOut(**vars(e)) for e in result.layers]
            ),
            blend=BlendOut(**vars(result.blend)),
            chunk_tiers=result.chunk_tiers,
        )
