"""POST /v1/query: retrieve, then generate over the retrieved chunks; JSON, or SSE events
`sources`, `delta`… and `result` (or `error`) when `stream` is true."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from common.errors import error_body
from common.sse import sse
from gateway.api.deps import ApiKeyDep, PipelineDep, SettingsDep, key_name
from gateway.api.rag import check_response_format, query_rag_request
from gateway.api.responses import GENERATION_ERRORS
from gateway.api.schemas.query import QueryRequest, QueryResponse, SourceOut
from gateway.api.streaming import (
    SSE_HEADERS,
    collect_unless_disconnected,
    open_generation,
)
from gateway.errors import GatewayDependencyError
from gateway.pipeline import TimedStream
from gateway.types import EngineResult

router = APIRouter(tags=["query"])
log = logging.getLogger(__name__)


@router.post("/v1/query", response_model=QueryResponse, responses=GENERATION_ERRORS)
async def query(
    body: QueryRequest,
    request: Request,
    pipeline: PipelineDep,
    settings: SettingsDep,
    key: ApiKeyDep,
):
    await check_response_format(body.response_format)
    rag = query_rag_request(
        body, settings=settings, key=key, max_model_len=pipeline.engines.max_model_len
    )
    log.info("query top_k=%d collections=%s key=%s", rag.top_k, rag.collections, key_name(key))
    stream, stack = await open_generation(pipeline, rag, request)
    generation = stream.generation

    def response(outcome: EngineResult) -> QueryResponse:
        return QueryResponse.of(
            outcome,
            body.mode,
            generation.used_sources(outcome.dropped_chunks),
            retrieval_s=stream.retrieval_s,
            ttft_s=stream.ttft_s,
            total_s=time.perf_counter() - request.state.arrived_at,
            request_id=request.state.request_id,
        )

    if body.stream:
        return StreamingResponse(
            _events(stream, stack, response),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-RAGBlend-Engine": stream.engine},
            background=BackgroundTask(stack.aclose),
        )
    async with stack:
        outcome = await collect_unless_disconnected(stream, request)
    if outcome is None:
        raise HTTPException(499, detail="client disconnected")
    return response(outcome)


async def _events(
    stream: TimedStream,
    stack: AsyncExitStack,
    response: Callable[[EngineResult], QueryResponse],
) -> AsyncIterator[str]:
    """`sources` lists what was retrieved; the `result` lists what the prompt kept."""
    async with stack:
        sources = stream.generation.sources
        yield sse({"sources": [SourceOut.of(s).model_dump() for s in sources]}, "sources")
        try:
            async for event in stream.events():
                if isinstance(event, EngineResult):
                    yield sse(response(event).model_dump(), "result")
                elif event.text:
                    yield sse({"text": event.text}, "delta")
        except GatewayDependencyError as exc:
            log.warning("stream failed: %s", exc)
            yield sse(error_body(str(exc)), "error")
