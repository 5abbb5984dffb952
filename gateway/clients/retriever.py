"""Client of the retriever service: search, document ingest/list/show/delete, health."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from gateway.clients.upstream import Upstream
from gateway.types import Source


class RetrieverClient:
    def __init__(
        self,
        upstream: Upstream,
        base_url: str,
        *,
        connect_timeout_s: float,
        search_timeout_s: float,
        ingest_timeout_s: float,
    ):
        self.upstream = upstream
        self.base_url = base_url
        self.search_timeout = httpx.Timeout(search_timeout_s, connect=connect_timeout_s)
        self.ingest_timeout = httpx.Timeout(ingest_timeout_s, connect=connect_timeout_s)

    def _doc_url(self, doc_id: str) -> str:
        # doc ids may hold '/', which the retriever routes with a path converter.
        return f"{self.base_url}/v1/documents/{quote(doc_id, safe='/:@+')}"

    async def search(
        self, query: str, top_k: int, doc_ids: list[str] | None, *, request_id: str
    ) -> list[Source]:
        body: dict[str, Any] = {"query": query, "top_k": top_k}
        if doc_ids:
            body["doc_ids"] = doc_ids
        response = await self.upstream.request(
            "POST",
            f"{self.base_url}/v1/search",
            json=body,
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=True,
        )
        return [
            Source(r["chunk_id"], r["doc_id"], float(r["score"]), r["text"])
            for r in response.json()["results"]
        ]

    async def ingest(self, content: bytes, content_type: str, *, request_id: str) -> dict:
        """Forward a JSON or multipart body unchanged, so the gateway accepts exactly what the
        retriever accepts; not retried (a replaced document must not be replaced twice)."""
        response = await self.upstream.request(
            "POST",
            f"{self.base_url}/v1/documents",
            content=content,
            headers={"Content-Type": content_type},
            request_id=request_id,
            timeout=self.ingest_timeout,
            idempotent=False,
        )
        return response.json()

    async def list_documents(self, limit: int, offset: int, *, request_id: str) -> dict:
        response = await self.upstream.request(
            "GET",
            f"{self.base_url}/v1/documents",
            params={"limit": limit, "offset": offset},
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=True,
        )
        return response.json()

    async def get_document(self, doc_id: str, *, request_id: str) -> dict:
        """The document with its chunks (ids and text); DependencyRejectedError(404) when the
        retriever does not know it."""
        response = await self.upstream.request(
            "GET",
            self._doc_url(doc_id),
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=True,
        )
        return response.json()

    async def delete_document(self, doc_id: str, *, request_id: str) -> dict:
        response = await self.upstream.request(
            "DELETE",
            self._doc_url(doc_id),
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=True,
        )
        return response.json()

    async def health(self, *, request_id: str) -> dict:
        response = await self.upstream.request(
            "GET",
            f"{self.base_url}/health",
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=False,
        )
        return response.json()
