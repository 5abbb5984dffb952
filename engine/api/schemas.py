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
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engine import types
from engine.types import Chunk, GenerateRequest, GenerateResult, Turn


def to_request(body: GenerateBody) -> GenerateRequest:
    return GenerateRequest(
        question=body.question,
        chunks=tuple(Chunk(c.id, c.text, c.cache_salt) for c in body.chunks),
        system=body.system,
        history=tuple(Turn(t.role, t.text) for t in body.history),
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
        raw_prompt=body.raw_prompt,
        prompt_token_ids=None if body.prompt_token_ids is None else tuple(body.prompt_token_ids),
        logprobs=body.logprobs,
        prompt_logprobs=body.prompt_logprobs,
        json_schema=None if body.response_format is None else body.response_format.schema_text(),
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
        logprobs=logprobs_out(result.logprobs),
        prompt_logprobs=logprobs_out(result.prompt_logprobs),
        dropped_turns=result.dropped_turns,
    )


def logprob_out(entry: types.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=entry.token_id,
        token=entry.token,
        logprob=entry.logprob,
        top_logprobs=[
            TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)  # type: ignore[arg-type]
            for t in entry.top
        ],
    )


def logprobs_out(entries: list[types.TokenLogprob] | None) -> list[TokenLogprob] | None:
    return None if entries is None else [logprob_out(e) for e in entries]


class ErrorOut(BaseModel):
    """The one error body of every service (common.errors)."""

    detail: str
    errors: list[dict[str, Any]]


_STATUS_MEANING = {
    400: "body is not UTF-8, or a response_format whose JSON schema does not compile",
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
