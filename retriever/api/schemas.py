"""Request and response bodies of the retriever HTTP API (docs/design.md, "HTTP contracts"), one
model per direction, converted at the routes into the domain's dataclasses."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator

from common.errors import error_body
from common.validation import DocId, Text

# Metadata travels with every listing and detail answer: kept small, as serialised JSON.
MAX_METADATA_BYTES = 64 * 1024
MAX_OFFSET = 2**31


def _not_blank(value: str, name: str) -> str:
    if not value.strip():
        raise ValueError(f"{name} is empty")
    return value


def _bounded_metadata(value: dict[str, Any]) -> dict[str, Any]:
    """Metadata must come back out as JSON: finite numbers, encodable text, bounded size."""
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"metadata cannot be stored as JSON: {exc}") from None
    if len(encoded) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(encoded)} bytes as JSON, above {MAX_METADATA_BYTES}")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_bounded_metadata)]


class DocumentCreateRequest(BaseModel):
    # The length limit is the max_document_chars setting, checked before any work is done.
    text: Text = Field(description="The document's text; must not be blank.")
    metadata: Metadata = Field(default_factory=dict)
    id: DocId | None = Field(default=None, description="doc_id; default: a content hash")

    @field_validator("text")
    @classmethod
    def _text_not_blank(cls, value: str) -> str:
        return _not_blank(value, "text")


class DocumentCreateResponse(BaseModel):
    collection: str
    doc_id: str
    chunk_ids: list[str]
    status: Literal["created", "replaced", "unchanged"]
    num_tokens: int


class DocumentSummary(BaseModel):
    collection: str
    doc_id: str
    metadata: dict[str, Any]
    num_chunks: int
    num_tokens: int
    num_chars: int
    created_at: float


class DocumentListResponse(BaseModel):
    documents: list[DocumentSummary]
    total: int


class ChunkOut(BaseModel):
    chunk_id: str
    position: int
    num_tokens: int
    start_char: int
    end_char: int
    text: str


class DocumentDetailResponse(DocumentSummary):
    chunks: list[ChunkOut]


class DocumentDeleteResponse(BaseModel):
    collection: str
    doc_id: str
    deleted_chunks: int


class HealthResponse(BaseModel):
    status: Literal["ok"]
    documents: int
    chunks: int
    index: str
    index_vectors: int
    # ivf/ivfpq: whether the vectors are in inverted lists yet (before that, flat and exact);
    # None for the kinds that do not train.
    index_trained: bool | None
    embedding_model: str
    chunk_tokens: int


class ErrorBody(BaseModel):
    """The one error body of every service (common.errors)."""

    detail: str
    errors: list[dict[str, Any]]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` declaring the error statuses a route may answer with."""
    meaning = {
        400: "malformed body (JSON that is not UTF-8, a broken multipart form)",
        401: "missing or wrong internal token",
        403: "request from a foreign Origin",
        404: "unknown document",
        413: "body or document above a size limit",
        415: "content type (or uploaded file type) not accepted",
        422: "invalid request",
        503: "service not ready",
    }
    example = error_body("what is wrong")
    return {
        status: {
            "model": ErrorBody,
            "description": meaning[status],
            "content": {"application/json": {"example": example}},
        }
        for status in statuses
    }
