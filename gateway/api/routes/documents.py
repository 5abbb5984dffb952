"""/v1/documents: ingest through the retriever (the same JSON or multipart forms it accepts),
then precompute the chunks' KV in the background; list, show with status, delete."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from gateway.api.deps import IngestDep, PipelineDep, RequestIdDep
from gateway.api.schemas.documents import (
    DocumentCreated,
    DocumentDeleted,
    DocumentDetail,
    DocumentList,
    PrecomputeOut,
)

router = APIRouter(prefix="/v1/documents", tags=["documents"])


@router.post("", response_model=DocumentCreated)
async def create_document(
    request: Request, pipeline: PipelineDep, ingest: IngestDep, request_id: RequestIdDep
) -> DocumentCreated:
    """Returns once the retriever has indexed the document; poll GET /v1/documents/{doc_id}
    until `precompute.status` is `ready` (or `failed`)."""
    created = await pipeline.retriever.ingest(
        await request.body(),
        request.headers.get("content-type", "application/json"),
        request_id=request_id,
    )
    status = ingest.start(created["doc_id"], request_id=request_id)
    return DocumentCreated(
        doc_id=created["doc_id"],
        chunk_ids=created["chunk_ids"],
        status=created["status"],
        num_tokens=created.get("num_tokens"),
        precompute=PrecomputeOut.of(status),
    )


@router.get("", response_model=DocumentList)
async def list_documents(
    pipeline: PipelineDep,
    request_id: RequestIdDep,
    limit: int = Query(1000, ge=1, le=100_000),
    offset: int = Query(0, ge=0),
) -> DocumentList:
    return DocumentList(
        **await pipeline.retriever.list_documents(limit, offset, request_id=request_id)
    )


@router.get("/{doc_id:path}", response_model=DocumentDetail)
async def get_document(
    doc_id: str, pipeline: PipelineDep, ingest: IngestDep, request_id: RequestIdDep
) -> DocumentDetail:
    document = await pipeline.retriever.get_document(doc_id, request_id=request_id)
    return DocumentDetail(**document, precompute=PrecomputeOut.of(ingest.status(doc_id)))


@router.delete("/{doc_id:path}", response_model=DocumentDeleted)
async def delete_document(
    doc_id: str, pipeline: PipelineDep, ingest: IngestDep, request_id: RequestIdDep
) -> DocumentDeleted:
    """Removes the document from the index; its chunks' KV stays in the engines' tiers until
    evicted (another document may share a chunk, since chunk ids are content hashes)."""
    deleted = await pipeline.retriever.delete_document(doc_id, request_id=request_id)
    ingest.forget(doc_id)
    return DocumentDeleted(**deleted)
