"""GET /health and GET /metrics of the engine service."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.api.deps import EngineDep, MetricsDep

router = APIRouter()


@router.get("/health")
async def health(engine: EngineDep) -> dict:
    stats = engine.store.stats()
    return {
        "status": "ok",
        "model": engine.loaded.path,
        "fingerprint": engine.fingerprint,
        "device": str(engine.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "requests_running": engine.num_running,
        "requests_waiting": engine.num_waiting,
        "store": {
            "memory": {"entries": stats.memory.entries, "bytes": stats.memory.bytes},
            "ssd": None
            if stats.ssd is None
            else {"entries": stats.ssd.entries, "bytes": stats.ssd.bytes},
        },
    }


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
