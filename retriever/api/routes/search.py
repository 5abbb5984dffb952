"""`POST /v1/search`: the top_k chunks best matching a query (dense, BM25 or both fused), and
with `hops: 2` the chunks its first results lead to."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, HTTPException
from starlette.concurrency import run_in_threadpool

from common.contract import SearchRequest, SearchResponse, SearchResult
from retriever.api.deps import MetricsDep, ServiceDep, SettingsDep
from retriever.api.schemas import error_responses
from retriever.service import UnknownDocumentError

router = APIRouter(prefix="/v1", tags=["search"])
logger = logging.getLogger(__name__)


@router.post(
    "/search",
    response_model=SearchResponse,
    responses=error_responses(400, 401, 403, 404, 413, 415, 422, 503),
)
async def search(
    body: SearchRequest, service: ServiceDep, settings: SettingsDep, metrics: MetricsDep
) -> SearchResponse:
    if body.top_k > settings.max_top_k:
        raise HTTPException(
            status_code=422,
            detail=f"top_k must be between 1 and {settings.max_top_k} (max_top_k), "
            f"got {body.top_k}",
        )
    retrieval = body.retrieval or settings.retrieval
    if body.min_score is not None and retrieval == "bm25":
        raise HTTPException(
            status_code=422,
            detail="min_score is a cosine similarity: it applies to dense or hybrid retrieval, "
            "not bm25",
        )
    started = time.perf_counter()
    try:
        hits = await run_in_threadpool(
            service.search,
            body.query,
            body.top_k,
            body.doc_ids,
            body.min_score,
            body.collections,
            retrieval,
            body.hops,
        )
    except UnknownDocumentError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    elapsed_s = time.perf_counter() - started
    metrics.search_latency_s.observe(elapsed_s)
    logger.info(
        "search top_k=%d retrieval=%s hops=%d results=%d in %.1f ms",
        body.top_k,
        retrieval,
        body.hops,
        len(hits),
        elapsed_s * 1e3,
    )
    return SearchResponse(
        results=[
            SearchResult(
                chunk_id=h.chunk_id,
                collection=h.collection,
                doc_id=h.doc_id,
                score=h.score,
                text=h.text,
                num_tokens=h.num_tokens,
                hop=h.hop,
            )
            for h in hits
        ]
    )
