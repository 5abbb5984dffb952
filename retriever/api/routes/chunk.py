"""`POST /v1/chunk`: texts split into chunks as an ingested document is, stored nowhere; the
gateway chunks the passages a request brings this way, so that they blend like documents."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from starlette.concurrency import run_in_threadpool

from common.contract import MAX_GENERATE_CHUNKS, ChunkTextsRequest, ChunkTextsResponse, TextChunk
from retriever.api.deps import ServiceDep
from retriever.api.schemas import error_responses
from retriever.service import RetrieverService

router = APIRouter(prefix="/v1", tags=["chunk"])


@router.post(
    "/chunk",
    response_model=ChunkTextsResponse,
    responses=error_responses(400, 401, 403, 413, 415, 422, 503),
)
async def chunk(body: ChunkTextsRequest, service: ServiceDep) -> ChunkTextsResponse:
    """Per text, its chunks in order (none for a text without tokens); a 422 when they are
    more than one generation may carry."""
    answer = await run_in_threadpool(_chunk_all, service, body.texts)
    total = sum(len(chunks) for chunks in answer.chunks)
    if total > MAX_GENERATE_CHUNKS:
        raise HTTPException(
            422,
            detail=f"documents: the texts split into {total} chunks, more than the "
            f"{MAX_GENERATE_CHUNKS} of one generation",
        )
    return answer


def _chunk_all(service: RetrieverService, texts: list[str]) -> ChunkTextsResponse:
    return ChunkTextsResponse(
        chunks=[
            [TextChunk(chunk_id=c.chunk_id, text=c.text, num_tokens=c.num_tokens) for c in pieces]
            for pieces in map(service.chunk, texts)
        ]
    )
