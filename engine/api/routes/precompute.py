"""POST /v1/precompute: store the KV of chunks, as background work behind generations."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from common.contract import PrecomputeRequest, PrecomputeResponse
from engine.api.deps import EngineDep, MetricsDep, SettingsDep, check_text_limits
from engine.api.routes.generate import RETRY_AFTER_S
from engine.api.schemas import error_responses
from engine.errors import BackgroundQueueFullError, InvalidRequestError
from engine.types import Chunk

router = APIRouter()


@router.post(
    "/v1/precompute",
    response_model=PrecomputeResponse,
    responses=error_responses(400, 401, 403, 413, 415, 422, 429, 500, 503),
)
async def precompute(
    body: PrecomputeRequest, engine: EngineDep, metrics: MetricsDep, settings: SettingsDep
):
    """`stored`: chunks written to the store's last tier (SSD, else memory); `skipped`: there
    already; `failed`: computed but not written (e.g. a full disk). A chunk longer than a
    prompt could hold is a 422 naming it, before anything is computed; a background queue
    without room for every missing chunk a 429 (none is queued)."""
    check_text_limits(
        ((f"chunks.{i}.text", c.text) for i, c in enumerate(body.chunks)), settings.max_text_chars
    )
    try:
        result = await engine.aprecompute([Chunk(c.id, c.text, c.cache_salt) for c in body.chunks])
    except InvalidRequestError as exc:
        raise HTTPException(422, detail=str(exc)) from exc
    except BackgroundQueueFullError as exc:
        metrics.errors.labels("background_full").inc()
        raise HTTPException(
            429, detail=f"engine busy: {exc}", headers={"Retry-After": str(RETRY_AFTER_S[1])}
        ) from exc
    metrics.precomputed_chunks.labels("stored").inc(result.stored)
    metrics.precomputed_chunks.labels("skipped").inc(result.skipped)
    metrics.precomputed_chunks.labels("failed").inc(result.failed)
    return PrecomputeResponse(
        stored=result.stored, skipped=result.skipped, failed=result.failed, bytes=result.bytes
    )
