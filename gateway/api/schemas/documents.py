"""Bodies of /v1/documents at the gateway: the retriever's answers plus the precompute status."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.ingest import IngestStatus

PrecomputeState = Literal["pending", "ready", "failed", "unknown"]


class PrecomputeOut(BaseModel):
    status: PrecomputeState
    error: str | None = None
    engines: dict[str, str] = {}

    @classmethod
    def of(cls, status: IngestStatus | None) -> PrecomputeOut:
        """`unknown`: ingested before this gateway process started, or straight into the
        retriever; the engines compute such chunks on first use."""
        if status is None:
            return cls(status="unknown")
        return cls(status=status.status, error=status.error, engines=dict(status.engines))


class DocumentCreated(BaseModel):
    doc_id: str
    collection: str
    chunk_ids: list[str]
    status: str  # the retriever's: created, replaced or unchanged
    num_tokens: int | None = None
    precompute: PrecomputeOut


class DocumentDetail(BaseModel):
    # The retriever's fields (metadata, chunks with text, counts) pass through.
    model_config = ConfigDict(extra="allow")

    doc_id: str
    collection: str
    chunks: list[dict[str, Any]]
    precompute: PrecomputeOut


class DocumentList(BaseModel):
    model_config = ConfigDict(extra="allow")

    collection: str
    documents: list[dict[str, Any]]
    total: int


class DocumentDeleted(BaseModel):
    doc_id: str
    collection: str
    deleted_chunks: int
