"""Request and response bodies of the engine service, one model per direction."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from common.validation import Seed, Text
from engine.types import (
    MAX_ADDITIVE_PENALTY,
    MAX_REPETITION_PENALTY,
    Chunk,
    ChunkOrder,
    GenerateRequest,
    GenerateResult,
    Mode,
)

ModeName = Literal["cacheblend", "full_prefill", "prefix_cache", "full_reuse"]
ChunkOrderName = Literal["best_first", "best_last"]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
# None: the engine's default (its presence_penalty, frequency_penalty, repetition_penalty settings).
AdditivePenalty = Annotated[
    float, Field(ge=-MAX_ADDITIVE_PENALTY, le=MAX_ADDITIVE_PENALTY, allow_inf_nan=False)
]
RepetitionPenalty = Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]


class ChunkIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "0" is not 0, nor 0 False

    id: Text = Field(min_length=1, max_length=256)
    # Capped by the max_text_chars setting, checked at the route.
    text: Text = Field(min_length=1)


class PrecomputeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "0" is not 0, nor 0 False

    chunks: list[ChunkIn] = Field(max_length=10_000)


class PrecomputeResponse(BaseModel):
    stored: int  # entries written to the store's last tier (SSD, else memory)
    skipped: int  # already stored
    failed: int  # computed but not written (e.g. the disk is full): memory-only at best
    bytes: int


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "0" is not 0, nor 0 False

    # question, system and chunk texts: capped by the max_text_chars setting at the route.
    system: Text | None = None
    chunks: list[ChunkIn] = Field(default_factory=list, max_length=1_000)
    question: Text = Field(min_length=1)
    mode: ModeName = "cacheblend"
    recompute_ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, le=10, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = None
    frequency_penalty: AdditivePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | StopString | None = None
    ignore_eos: bool = False
    stream: bool = False
    fit_context: bool = False
    # The chunks come best first; best_last lays them out reversed, the best next to the question.
    chunk_order: ChunkOrderName = "best_first"

    def texts(self) -> list[tuple[str, str]]:
        """(field name, text) of every free text, for the length limit."""
        named = [("question", self.question), ("system", self.system or "")]
        return named + [(f"chunks.{i}.text", c.text) for i, c in enumerate(self.chunks)]

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
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            fit_context=self.fit_context,
            chunk_order=ChunkOrder(self.chunk_order),
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
    dropped_chunks: int  # dropped from the end by fit_context; 0 without it

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
            dropped_chunks=result.dropped_chunks,
        )


class ErrorOut(BaseModel):
    """The one error body of every service (common.errors)."""

    detail: str
    errors: list[dict[str, Any]]


_STATUS_MEANING = {
    400: "body is not UTF-8",
    401: "missing or wrong internal token",
    403: "a cross-site Origin",
    413: "body larger than max_body_bytes",
    415: "body not JSON",
    422: "invalid request (the detail names the field)",
    429: "queue and KV pool full; see Retry-After",
    499: "the client disconnected",
    500: "internal error (logged with the request id)",
    503: "the model is not loaded",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route can return, in the one error body."""
    return {
        status: {"model": ErrorOut, "description": _STATUS_MEANING[status]} for status in statuses
    }
