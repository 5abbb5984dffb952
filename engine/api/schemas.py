"""The engine service's side of the wire contract (common.contract): its bodies converted to
and from the engine's typed requests and results, and the error responses of its routes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from common.contract import (
    Blend,
    GenerateBody,
    GenerateResponse,
    LayerTimings,
    Timings,
    Usage,
)
from engine.types import Chunk, GenerateRequest, GenerateResult


def to_request(body: GenerateBody) -> GenerateRequest:
    return GenerateRequest(
        question=body.question,
        chunks=tuple(Chunk(c.id, c.text, c.cache_salt) for c in body.chunks),
        system=body.system,
        mode=body.mode,
        recompute_ratio=body.recompute_ratio,
        selection=body.selection,
        max_recompute_ratio=body.max_recompute_ratio,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop=tuple(body.stop_list),
        ignore_eos=body.ignore_eos,
        fit_context=body.fit_context,
        chunk_order=body.chunk_order,
        cache_salt=body.cache_salt,
    )


def response_of(result: GenerateResult) -> GenerateResponse:
    return GenerateResponse(
        text=result.text,
        finish_reason=result.finish_reason,
        usage=Usage(**vars(result.usage)),
        timings=Timings(
            **vars(result.timings), layers=[LayerTimings(**vars(e)) for e in result.layers]
        ),
        blend=Blend(**vars(result.blend)),
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
