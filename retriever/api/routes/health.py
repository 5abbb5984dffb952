"""`GET /health` (ready once the model and index are loaded) and `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from retriever.api.deps import MetricsDep, ServiceDep
from retriever.api.schemas import HealthResponse, error_responses

router = APIRouter(tags=["health"])


@router.get("/health", response_model=HealthResponse, responses=error_responses(503))
async def health(service: ServiceDep) -> HealthResponse:
    stats = await run_in_threadpool(service.stats)
    return HealthResponse(
        status="ok",
        documents=stats.documents,
        chunks=stats.chunks,
        index=service.settings.index,
        index_vectors=stats.index_vectors,
        index_trained=service.index.trained if service.index.params.ivf else None,
        embedding_model=service.embedder.info.model,
        chunk_tokens=service.settings.chunk_tokens,
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"},
        **error_responses(503),
    },
)
async def metrics(service: ServiceDep, metrics: MetricsDep) -> Response:
    stats = await run_in_threadpool(service.stats)
    return Response(content=metrics.render(stats), media_type=CONTENT_TYPE_LATEST)
