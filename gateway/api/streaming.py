"""Helpers of the generating routes: open the engine stream before answering (so a down or
busy engine is a status code, not a broken stream), and wait for a non-streamed answer while
watching for the client to leave."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AsyncExitStack

from fastapi import Request

from gateway.errors import http_status
from gateway.pipeline import Pipeline, TimedStream
from gateway.types import EngineResult, RagRequest

DISCONNECT_POLL_S = 0.25
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_generation(
    pipeline: Pipeline, rag: RagRequest, request: Request
) -> tuple[TimedStream, AsyncExitStack]:
    """The open stream over the retrieved sources and the stack that closes it; the caller
    owns the stack (a streaming response closes it when it ends, however it ends)."""
    stack = AsyncExitStack()
    try:
        stream = await stack.enter_async_context(
            pipeline.start(
                rag,
                request_id=request.state.request_id,
                arrived_at=request.state.arrived_at,
            )
        )
    except BaseException:
        await stack.aclose()
        raise
    stack.callback(_record_failure, request, stream)
    return stream, stack


def _record_failure(request: Request, stream: TimedStream) -> None:
    """A stream that broke off after its 200 went out ends with an error event; the access
    log and the request metrics count it by the status it would have had (GatewayMiddleware
    reads `outcome_status`)."""
    if stream.failure is not None:
        request.state.outcome_status = http_status(stream.failure)


async def collect_unless_disconnected(stream: TimedStream, request: Request) -> EngineResult | None:
    """The outcome, or None when the client left first (the engine's work is then cancelled
    by closing its stream)."""
    task = asyncio.ensure_future(stream.collect())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()
