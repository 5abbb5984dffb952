"""Client of the retriever service: search, document ingest/list/show/delete per collection,
health."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from common.contract import ChunkTextsRequest, ChunkTextsResponse, SearchRequest, SearchResponse
from gateway.clients.upstream import Upstream
from gateway.types import RequestPassage, Source


class RetrieverClient:
    def __init__(
        self,
        upstream: Upstream,
        base_url: str,
        *,
        connect_timeout_s: float,
        search_timeout_s: float,
        ingest_timeout_s: float,
        health_timeout_s: float,
    ):
        self.upstream = upstream
        self.base_url = base_url
        self.search_timeout_s = search_timeout_s
        self.search_timeout = httpx.Timeout(search_timeout_s, connect=connect_timeout_s)
        self.ingest_timeout = httpx.Timeout(ingest_timeout_s, connect=connect_timeout_s)
        self.health_timeout_s = health_timeout_s

    def _doc_url(self, doc_id: str) -> str:
        # Every character quoted, '/' included: the retriever decodes the path before routing,
        # and nothing in an id can make the URL name another route.
        return f"{self.base_url}/v1/documents/{quote(doc_id, safe='')}"

    async def _read(self, method: str, url: str, request_id: str, **kwargs: Any) -> dict:
        """An idempotent call that a client waits on: bounded by the search timeout in all."""
        response = await self.upstream.request(
            method,
            url,
            request_id=request_id,
            timeout=self.search_timeout,
            idempotent=True,
            total_timeout_s=self.search_timeout_s,
            **kwargs,
        )
        return response.json()

    async def search(self, body: SearchRequest, *, request_id: str) -> list[Source]:
        """The top_k chunks, best first (with hops=2, up to top_k second-hop chunks after
        them)."""
        answer = await self._read(
            "POST", f"{self.base_url}/v1/search", request_id, json=body.model_dump(mode="json")
        )
        return [
            Source(r.chunk_id, r.doc_id, r.score, r.text, r.collection)
            for r in SearchResponse.model_validate(answer).results
        ]

    async def chunk_passages(
        self, passages: tuple[RequestPassage, ...], cache_salt: str, *, request_id: str
    ) -> list[Source]:
        """The passages split as the retriever splits a document, in order, each chunk salted
        with `cache_salt` (score 1: chosen by the application, not ranked)."""
        body = ChunkTextsRequest(texts=[p.text for p in passages])
        answer = await self._read(
            "POST", f"{self.base_url}/v1/chunk", request_id, json=body.model_dump(mode="json")
        )
        chunked = ChunkTextsResponse.model_validate(answer).chunks
        return [
            Source(c.chunk_id, passage.doc_id, 1.0, c.text, "", cache_salt)
            for passage, chunks in zip(passages, chunked, strict=True)
            for c in chunks
        ]

    async def ingest(
        self, content: bytes, content_type: str, collection: str, *, request_id: str
    ) -> dict:
        """Forward a JSON or multipart body unchanged, so the gateway accepts exactly what the
        retriever accepts; retried only when it was never sent (a replaced document must not
        be replaced twice)."""
        response = await self.upstream.request(
            "POST",
            f"{self.base_url}/v1/documents",
            params={"collection": collection},
            content=content,
            headers={"Content-Type": content_type},
            request_id=request_id,
            timeout=self.ingest_timeout,
            idempotent=False,
        )
        return response.json()

    async def list_documents(
        self, collection: str, limit: int, offset: int, *, request_id: str
    ) -> dict:
        params = {"collection": collection, "limit": limit, "offset": offset}
        return await self._read("GET", f"{self.base_url}/v1/documents", request_id, params=params)

    async def get_document(self, collection: str, doc_id: str, *, request_id: str) -> dict:
        """The document with its chunks (ids and text); DependencyRejectedError(404) when the
        retriever does not know it in that collection."""
        params = {"collection": collection}
        return await self._read("GET", self._doc_url(doc_id), request_id, params=params)

    async def delete_document(self, collection: str, doc_id: str, *, request_id: str) -> dict:
        params = {"collection": collection}
        return await self._read("DELETE", self._doc_url(doc_id), request_id, params=params)

    async def health(self, *, request_id: str) -> dict:
        """One short probe, not retried: /ready must answer quickly whatever the retriever
        does."""
        response = await self.upstream.request(
            "GET",
            f"{self.base_url}/health",
            request_id=request_id,
            timeout=httpx.Timeout(self.health_timeout_s),
            idempotent=False,
            total_timeout_s=self.health_timeout_s,
        )
        return response.json()
