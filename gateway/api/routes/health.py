"""GET /health (the gateway process answers), GET /ready (the retriever and at least one
engine answer, within about a second whatever they do) and GET /metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api.deps import MetricsDep, PipelineDep, RequestIdDep, SettingsDep
from gateway.api.responses import KEYED, READY_ERRORS
from gateway.errors import GatewayDependencyError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(settings: SettingsDep) -> dict:
    """Status and counts only: no dependency address reaches a client."""
    return {"status": "ok", "engines": len(settings.engine_urls)}


@router.get("/ready", responses=READY_ERRORS)
async def ready(pipeline: PipelineDep, request_id: RequestIdDep) -> dict:
    """200 when the retriever and at least one engine answer /health; else 503 saying which
    is down. Both are probed now, concurrently, each with health_timeout_s, so a hung
    dependency costs a second, not a request timeout (the probes also refresh the engines'
    health, so a restarted engine is used at once). `pool` gives each engine's state by its
    name, never its address."""
    retriever, engines_up = await asyncio.gather(
        pipeline.retriever.health(request_id=request_id),
        pipeline.engines.poll_all(),
        return_exceptions=True,
    )
    if isinstance(retriever, GatewayDependencyError):
        raise HTTPException(503, detail=f"retriever not ready: {retriever}")
    if isinstance(retriever, BaseException):
        raise retriever
    if isinstance(engines_up, BaseException):
        raise engines_up
    engines = pipeline.engines.engines
    if not engines_up:
        down = ", ".join(f"{e.name}: {e.reason}" for e in engines)
        raise HTTPException(
            503,
            detail=f"engine not ready: none of the {len(engines)} engines answers /health ({down})",
        )
    return {
        "status": "ready",
        "engines_up": engines_up,
        "engines": len(engines),
        "pool": {e.name: e.state() for e in engines},
    }


@router.get("/metrics", response_class=PlainTextResponse, responses=KEYED)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
