"""POST /v1/precompute: store the KV of chunks, as background work behind generations."""

from __future__ import annotations

from fastapi import APIRouter

from engine.api.deps import EngineDep, MetricsDep
from engine.api.schemas import PrecomputeRequest, PrecomputeResponse
from engine.types import Chunk

router = APIRouter()


@router.post("/v1/precompute", response_model=PrecomputeResponse)
async def precompute(body: PrecomputeRequest, engine: EngineDep, metrics: MetricsDep):
    result = await engine.aprecompute([Chunk(c.id, c.text) for c in body.chunks])
    metrics.precomputed_chunks.labels("stored").inc(result.stored)
    metrics.precomputed_chunks.labels("skipped").inc(result.skipped)
    return PrecomputeResponse(stored=result.stored, skipped=result.skipped, bytes=result.bytes)
