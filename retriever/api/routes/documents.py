"""`/v1/documents`: ingest (JSON body or multipart file upload), list, show and delete."""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from common.validation import DEFAULT_COLLECTION, CollectionName, DocId
from retriever.api.deps import MetricsDep, ServiceDep, SettingsDep
from retriever.api.schemas import (
    MAX_OFFSET,
    DocumentCreateRequest,
    DocumentCreateResponse,
    DocumentDeleteResponse,
    DocumentDetailResponse,
    DocumentListResponse,
    DocumentSummary,
    error_responses,
)
from retriever.catalog import DocumentRecord
from retriever.embeddings import EmbeddingStoppedError
from retriever.extract import (
    ExtractionError,
    ExtractionLimitError,
    UnsupportedFileTypeError,
    extract_text,
)
from retriever.malloc import trim_heap
from retriever.metrics import RetrieverMetrics
from retriever.service import (
    DocumentInput,
    DocumentTooLargeError,
    EmptyDocumentError,
    UnknownDocumentError,
)
from retriever.settings import RetrieverSettings

router = APIRouter(
    prefix="/v1/documents", tags=["documents"], responses=error_responses(401, 403, 422, 503)
)
logger = logging.getLogger(__name__)


CollectionDep = Annotated[
    CollectionName, Query(description="the collection the document belongs to")
]
DocIdPath = Annotated[DocId, Path(description="the document's id")]


def _fail(metrics: RetrieverMetrics, status: int, reason: str, detail: Any) -> HTTPException:
    metrics.ingest_failures.labels(reason=reason).inc()
    return HTTPException(status_code=status, detail=detail)


def _parse_json(data: bytes, collection: str, metrics: RetrieverMetrics) -> DocumentInput:
    try:
        body = DocumentCreateRequest.model_validate_json(data)
    except ValidationError as exc:
        raise _invalid(metrics, exc) from exc
    return DocumentInput(body.text, body.metadata, body.id, collection)


async def _read_upload(
    request: Request, collection: str, settings: RetrieverSettings, metrics: RetrieverMetrics
) -> DocumentInput:
    """A multipart form: `file` (required), `metadata` (a JSON object), `id`."""
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise _fail(metrics, 422, "invalid", "multipart upload needs a 'file' field")
    filename = upload.filename or "upload"
    # Starlette spools the upload to a temporary file; UploadFile.read runs in a thread, so
    # the event loop is never blocked on that file.
    data = await upload.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise _fail(
            metrics, 413, "too_large", f"{filename} exceeds {settings.max_upload_bytes} bytes"
        )
    try:
        extracted = await run_in_threadpool(
            extract_text, filename, data, settings.max_document_chars
        )
    except UnsupportedFileTypeError as exc:
        raise _fail(metrics, 415, "unsupported_type", str(exc)) from exc
    except ExtractionLimitError as exc:
        raise _fail(metrics, 413, "too_large", str(exc)) from exc
    except ExtractionError as exc:
        raise _fail(metrics, 422, "unreadable", str(exc)) from exc
    if not extracted.text.strip():
        raise _fail(metrics, 422, "empty", f"{filename} contains no text")
    metadata = dict(extracted.metadata)
    raw_metadata = form.get("metadata")
    if isinstance(raw_metadata, str) and raw_metadata:
        try:
            extra = json.loads(raw_metadata)
        except json.JSONDecodeError as exc:
            raise _fail(metrics, 422, "invalid", f"metadata is not valid JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise _fail(metrics, 422, "invalid", "metadata must be a JSON object")
        metadata.update(extra)
    doc_id = form.get("id")
    try:
        checked = DocumentCreateRequest(
            text=extracted.text,
            metadata=metadata,
            id=doc_id if isinstance(doc_id, str) and doc_id else None,
        )
    except ValidationError as exc:
        raise _invalid(metrics, exc) from exc
    return DocumentInput(extracted.text, checked.metadata, checked.id, collection)


def _invalid(metrics: RetrieverMetrics, exc: ValidationError) -> RequestValidationError:
    """A body checked here, not by FastAPI, fails like one FastAPI checked: the one 422 body."""
    metrics.ingest_failures.labels(reason="invalid").inc()
    return RequestValidationError(exc.errors(include_url=False))


def _summary(record: DocumentRecord) -> dict[str, Any]:
    return {
        "collection": record.collection,
        "doc_id": record.doc_id,
        "metadata": record.metadata,
        "num_chunks": record.num_chunks,
        "num_tokens": record.num_tokens,
        "num_chars": record.num_chars,
        "created_at": record.created_at,
    }


# The body is read by hand (JSON or multipart), so its two forms are declared here.
_CREATE_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": DocumentCreateRequest.model_json_schema()},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "metadata": {"type": "string", "description": "a JSON object"},
                    "id": {"type": "string"},
                },
                "required": ["file"],
            }
        },
    },
}


@router.post(
    "",
    response_model=DocumentCreateResponse,
    responses=error_responses(400, 413, 415),
    openapi_extra={"requestBody": _CREATE_BODY},
)
async def create_document(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    collection: CollectionDep = DEFAULT_COLLECTION,
) -> DocumentCreateResponse:
    """Ingest one document: a JSON body {text, metadata?, id?} or a multipart file upload."""
    started = time.perf_counter()
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        doc = await _read_upload(request, collection, settings, metrics)
    else:
        # Parsing up to max_upload_bytes of JSON takes a while: not on the event loop.
        doc = await run_in_threadpool(_parse_json, await request.body(), collection, metrics)
    try:
        result = await run_in_threadpool(service.ingest, doc)
    except EmptyDocumentError as exc:
        raise _fail(metrics, 422, "empty", str(exc)) from exc
    except DocumentTooLargeError as exc:
        raise _fail(metrics, 413, "too_large", str(exc)) from exc
    except EmbeddingStoppedError as exc:
        raise HTTPException(503, detail="the retriever is shutting down") from exc
    finally:
        # An ingest's text, tokens and batch buffers are freed now, but glibc keeps the pages.
        await run_in_threadpool(trim_heap)
    if result.status == "unchanged":
        metrics.documents_unchanged.inc()
    else:
        metrics.documents_ingested.inc()
        metrics.chunks_ingested.inc(len(result.chunk_ids))
    metrics.ingest_latency_s.observe(time.perf_counter() - started)
    logger.info("document %s %s: %d chunks", result.doc_id, result.status, len(result.chunk_ids))
    return DocumentCreateResponse(
        collection=result.collection,
        doc_id=result.doc_id,
        chunk_ids=result.chunk_ids,
        status=result.status,
        num_tokens=result.num_tokens,
    )


@router.get("", response_model=DocumentListResponse)
async def list_documents(
    service: ServiceDep,
    collection: CollectionDep = DEFAULT_COLLECTION,
    limit: int = Query(1000, ge=1, le=100_000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
) -> DocumentListResponse:
    records, total = await run_in_threadpool(service.list_documents, collection, limit, offset)
    return DocumentListResponse(
        documents=[DocumentSummary(**_summary(r)) for r in records], total=total
    )


@router.get("/{doc_id:path}", response_model=DocumentDetailResponse, responses=error_responses(404))
async def get_document(
    doc_id: DocIdPath, service: ServiceDep, collection: CollectionDep = DEFAULT_COLLECTION
) -> DocumentDetailResponse:
    try:
        record, chunks = await run_in_threadpool(service.get_document, collection, doc_id)
    except UnknownDocumentError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    return DocumentDetailResponse(
        **_summary(record),
        chunks=[
            {
                "chunk_id": c.chunk_id,
                "position": c.position,
                "num_tokens": c.num_tokens,
                "start_char": c.start_char,
                "end_char": c.end_char,
                "text": c.text,
            }
            for c in chunks
        ],
    )


@router.delete(
    "/{doc_id:path}", response_model=DocumentDeleteResponse, responses=error_responses(404)
)
async def delete_document(
    doc_id: DocIdPath,
    service: ServiceDep,
    metrics: MetricsDep,
    collection: CollectionDep = DEFAULT_COLLECTION,
) -> DocumentDeleteResponse:
    try:
        deleted = await run_in_threadpool(service.delete, collection, doc_id)
    except UnknownDocumentError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    metrics.documents_deleted.inc()
    return DocumentDeleteResponse(collection=collection, doc_id=doc_id, deleted_chunks=deleted)
