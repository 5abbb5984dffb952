"""Request and response bodies of the retriever HTTP API (DESIGN.md section 2), one model
per direction, converted at the routes into the domain's dataclasses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

DOC_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,199}$"


def _not_blank(value: str, name: str) -> str:
    if not value.strip():
        raise ValueError(f"{name} is empty")
    return value


class DocumentCreateRequest(BaseModel):
    text: str = Field(description="The document's text; must not be blank.")
    metadata: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(
        default=None,
        pattern=DOC_ID_PATTERN,
        description="doc_id; default: a content hash of the text",
    )

    @field_validator("text")
    @classmethod
    def _text_not_blank(cls, value: str) -> str:
        return _not_blank(value, "text")


class DocumentCreateResponse(BaseModel):
    doc_id: str
    chunk_ids: list[str]
    status: Literal["created", "replaced", "unchanged"]
    num_tokens: int


class DocumentSummary(BaseModel):
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
    doc_id: str
    deleted_chunks: int


class SearchRequest(BaseModel):
    query: str
    # The upper bound is a runtime setting (max_top_k), checked in the route.
    top_k: int = Field(default=5, gt=0)
    doc_ids: list[str] | None = Field(default=None, min_length=1)
    min_score: float | None = Field(default=None, ge=-1.0, le=1.0)

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, value: str) -> str:
        return _not_blank(value, "query")


class SearchResult(BaseModel):
    chunk_id: str
    doc_id: str
    score: float
    text: str


class SearchResponse(BaseModel):
    results: list[SearchResult]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    documents: int
    chunks: int
    index: str
    index_vectors: int
    embedding_model: str
    chunk_tokens: int
