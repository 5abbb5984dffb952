"""/v1/documents: ingest through the retriever (the same JSON or multipart forms it accepts)
into a collection, then precompute the chunks' KV in the background; list, show with status,
delete."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from common.validation import DocId
from gateway.api.deps import (
    ApiKeyDep,
    CollectionDep,
    IngestDep,
    PipelineDep,
    RequestIdDep,
    key_name,
)
from gateway.api.responses import (
    DOCUMENT_CREATE_ERRORS,
    DOCUMENT_DELETE_ERRORS,
    DOCUMENT_LIST_ERRORS,
    DOCUMENT_READ_ERRORS,
)
from gateway.api.schemas.documents import (
    DocumentCreated,
    DocumentDeleted,
    DocumentDetail,
    DocumentList,
    PrecomputeOut,
)

router = APIRouter(prefix="/v1/documents", tags=["documents"])
log = logging.getLogger(__name__)
# Checked here, so that no id ever names another route of the retriever ('..', '%2F'…).
DocIdPath = Annotated[DocId, Path(description="letters, digits and ._:@+- in '/'-segments")]


@router.post("", response_model=DocumentCreated, responses=DOCUMENT_CREATE_ERRORS)
async def create_document(
    request: Request,
    pipeline: PipelineDep,
    ingest: IngestDep,
    request_id: RequestIdDep,
    collection: CollectionDep,
    key: ApiKeyDep,
) -> DocumentCreated:
    """Returns once the retriever has indexed the document; poll GET /v1/documents/{doc_id}
    until `precompute.status` is `ready` (or `failed`)."""
    created = await pipeline.retriever.ingest(
        await request.body(),
        request.headers.get("content-type", "application/json"),
        collection,
        request_id=request_id,
    )
    log.info(
        "document %s/%s %s by key %s",
        collection,
        created["doc_id"],
        created["status"],
        key_name(key),
    )
    status = ingest.start(collection, created["doc_id"], request_id=request_id)
    return DocumentCreated(
        doc_id=created["doc_id"],
        collection=collection,
        chunk_ids=created["chunk_ids"],
        status=created["status"],
        num_tokens=created.get("num_tokens"),
        precompute=PrecomputeOut.of(status),
    )


@router.get("", response_model=DocumentList, responses=DOCUMENT_LIST_ERRORS)
async def list_documents(
    pipeline: PipelineDep,
    request_id: RequestIdDep,
    collection: CollectionDep,
    limit: int = Query(1000, ge=1, le=100_000),
    offset: int = Query(0, ge=0, le=2**31),
) -> DocumentList:
    listed = await pipeline.retriever.list_documents(
        collection, limit, offset, request_id=request_id
    )
    return DocumentList(**{**listed, "collection": collection})


@router.get("/{doc_id:path}", response_model=DocumentDetail, responses=DOCUMENT_READ_ERRORS)
async def get_document(
    doc_id: DocIdPath,
    pipeline: PipelineDep,
    ingest: IngestDep,
    request_id: RequestIdDep,
    collection: CollectionDep,
) -> DocumentDetail:
    document = await pipeline.retriever.get_document(collection, doc_id, request_id=request_id)
    return DocumentDetail(
        **{**document, "collection": collection},
        precompute=PrecomputeOut.of(ingest.status(collection, doc_id)),
    )


@router.delete("/{doc_id:path}", response_model=DocumentDeleted, responses=DOCUMENT_DELETE_ERRORS)
async def delete_document(
    doc_id: DocIdPath,
    pipeline: PipelineDep,
    ingest: IngestDep,
    request_id: RequestIdDep,
    collection: CollectionDep,
    key: ApiKeyDep,
) -> DocumentDeleted:
    """Removes the document from the index; its chunks' KV stays in the engines' tiers until
    evicted (another document may share a chunk, since chunk ids are content hashes)."""
    deleted = await pipeline.retriever.delete_document(collection, doc_id, request_id=request_id)
    log.info("document %s/%s deleted by key %s", collection, doc_id, key_name(key))
    ingest.forget(collection, doc_id)
    return DocumentDeleted(
        doc_id=deleted["doc_id"], collection=collection, deleted_chunks=deleted["deleted_chunks"]
    )
