"""GET /health (the gateway process answers), GET /ready (the retriever and at least one
engine answer) and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api.deps import MetricsDep, PipelineDep, RequestIdDep, SettingsDep
from gateway.errors import GatewayDependencyError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(settings: SettingsDep) -> dict:
    return {"status": "ok", "retriever": settings.retriever_url, "engines": settings.engine_urls}


@router.get("/ready")
async def ready(pipeline: PipelineDep, request_id: RequestIdDep) -> dict:
    """200 when the retriever and at least one engine answer /health; else 503 naming what
    is down (checked live, so the gateway is ready again as soon as they are back)."""
    try:
        retriever = await pipeline.retriever.health(request_id=request_id)
    except GatewayDependencyError as exc:
        raise HTTPException(503, detail=f"retriever not ready: {exc}") from exc
    engines = await pipeline.engines.healthy_urls(request_id=request_id)
    if not engines:
        raise HTTPException(
            503,
            detail="engine not ready: none of "
            + ", ".join(pipeline.engines.urls)
            + " answers /health",
        )
    return {
        "status": "ready",
        "engines_up": engines,
        "documents": retriever.get("documents"),
        "chunks": retriever.get("chunks"),
    }


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
