"""POST /v1/generate: JSON, or an SSE stream of token deltas ending in the full result."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from common.contract import QUEUE_ESTIMATE_HEADER, Delta, GenerateBody, GenerateResponse
from common.errors import error_body
from common.request_id import request_id_var
from common.sse import sse
from engine.api.deps import EngineDep, MetricsDep, SettingsDep, check_text_limits
from engine.api.schemas import (
    error_responses,
    logprob_out,
    logprobs_out,
    response_of,
    to_request,
)
from engine.blend.layout import PromptLayout
from engine.engine import Engine
from engine.errors import GenerationCancelled, GrammarError, InvalidRequestError, QueueFullError
from engine.streaming import Generation
from engine.types import GenerateRequest, GenerateResult, Mode, TokenDelta
from kvstore.loader import KVLayerStream

router = APIRouter()
log = logging.getLogger(__name__)
# Bounds of a 429's Retry-After (whole seconds), whatever the queue estimate says.
RETRY_AFTER_S = (1, 60)


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "JSON, or SSE with stream",
            "headers": {
                QUEUE_ESTIMATE_HEADER: {
                    "description": "with stream: the seconds the request is expected to wait "
                    "before its prefill starts, estimated as it was queued",
                    "schema": {"type": "number"},
                }
            },
        },
        **error_responses(400, 401, 403, 413, 415, 422, 429, 499, 500, 503),
    },
)
async def generate(
    body: GenerateBody, http: Request, engine: EngineDep, metrics: MetricsDep, settings: SettingsDep
):
    if body.max_tokens > settings.max_tokens_limit:
        raise HTTPException(
            422,
            detail=f"max_tokens: {body.max_tokens} is above the limit of "
            f"{settings.max_tokens_limit}",
        )
    check_text_limits(body.texts(), settings.max_text_chars)
    try:
        request = to_request(body)
        # Tokenizing a long prompt takes seconds, and its chunks' KV lookups read SSD headers
        # and ask Redis: on a thread, so that the event loop keeps serving /health and the
        # streams in flight. Length errors are a 422 before queueing.
        layout = await asyncio.to_thread(engine.layout, request)
        # A new schema compiles on a thread too (milliseconds,
        # docs/benchmarks/structured-output.md); a bad one is a 400 before
        # any KV is looked up.
        grammar = await asyncio.to_thread(engine.compile_grammar, request)
        opened = await _open_kv(engine, request, layout)
        generation = engine.start(request, layout, opened, grammar)
    except QueueFullError as exc:
        metrics.errors.labels("queue_full").inc()
        retry_after = min(max(math.ceil(engine.room_after_s()), RETRY_AFTER_S[0]), RETRY_AFTER_S[1])
        raise HTTPException(
            429, detail=f"engine busy: {exc}", headers={"Retry-After": str(retry_after)}
        ) from exc
    except GrammarError as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    except InvalidRequestError as exc:
        raise HTTPException(422, detail=str(exc)) from exc

    if body.stream:
        return StreamingResponse(
            _stream(generation, request.mode, metrics),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                QUEUE_ESTIMATE_HEADER: f"{generation.queue_estimate_s:.3f}",
            },
        )
    try:
        result = await _until_done_or_disconnect(generation, http)
    except HTTPException:
        raise
    except Exception as exc:
        log.exception("generation failed")
        metrics.errors.labels("generation").inc()
        raise HTTPException(500, detail=generation_failed()) from exc
    _record(metrics, request.mode, result)
    return response_of(result)


def generation_failed() -> str:
    # The exception's text may name internal paths: it goes to the log, the client gets the id.
    return f"generation failed: an internal error (request id {request_id_var.get()})"


def _record(metrics, mode: Mode, result: GenerateResult) -> None:
    metrics.observe(mode, result)
    log.info(
        "generated mode=%s prompt=%d cached=%d recomputed=%d completion=%d ratio=%.2f "
        "chosen_by=%s selection=%s ttft=%.3fs overlap=%.2f dropped=%d",
        mode.value,
        result.usage.prompt_tokens,
        result.usage.cached_tokens,
        result.usage.recomputed_tokens,
        result.usage.completion_tokens,
        result.blend.recompute_ratio,
        result.blend.chosen_by,
        result.blend.selection,
        result.timings.ttft_s,
        result.timings.overlap,
        result.dropped_chunks,
    )


async def _stream(generation: Generation, mode: Mode, metrics) -> AsyncIterator[str]:
    """Deltas as `event: delta`, then `event: result`; a disconnect cancels the generation."""
    try:
        async for event in generation:
            if isinstance(event, GenerateResult):
                _record(metrics, mode, event)
                yield sse(response_of(event).model_dump(), "result")
            elif event.logprobs is not None or event.prompt_logprobs is not None:
                yield sse(_delta(event).model_dump(), "delta")
            elif event.text:
                yield sse({"text": event.text}, "delta")  # the common case, built cheaply
    except Exception:
        log.exception("generation failed")
        metrics.errors.labels("generation").inc()
        yield sse(error_body(generation_failed()), "error")
    finally:
        generation.cancel()


def _delta(event: TokenDelta) -> Delta:
    return Delta(
        text=event.text,
        logprobs=None if event.logprobs is None else logprob_out(event.logprobs),
        prompt_logprobs=logprobs_out(event.prompt_logprobs),
    )


async def _until_done_or_disconnect(generation: Generation, http: Request) -> GenerateResult:
    async def result() -> GenerateResult:
        async for event in generation:
            if isinstance(event, GenerateResult):
                return event
        raise AssertionError("the generation ended without a result")

    task = asyncio.ensure_future(result())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await http.is_disconnected():
                generation.cancel()
                task.cancel()
                raise HTTPException(499, detail="client disconnected")
        return task.result()
    except GenerationCancelled as exc:
        raise HTTPException(499, detail="client disconnected") from exc


async def _open_kv(
    engine: Engine, request: GenerateRequest, layout: PromptLayout
) -> KVLayerStream | None:
    """`engine.open_kv` on a thread; a stream it opens after its caller was cancelled (the
    client left) is closed, not leaked."""
    future = asyncio.get_running_loop().run_in_executor(None, engine.open_kv, request, layout)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_opened)
        raise


def _close_opened(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None and future.result() is not None:
        future.result().close()
