"""Concurrent ingests and searches against one real process: every request succeeds, and
afterwards catalog and index agree on every document."""

from __future__ import annotations

import asyncio
import uuid

import httpx

NUM_DOCS = 16
NUM_SEARCHES = 24


async def test_concurrent_ingest_and_search_leave_catalog_and_index_consistent(shared_retriever):
    tag = uuid.uuid4().hex[:8]
    texts = [
        "\n\n".join(
            f"Concurrent {tag} document {i} paragraph {p}: the beacon on hill {i} "
            f"burns {p} barrels of oil every night."
            for p in range(8)
        )
        for i in range(NUM_DOCS)
    ]
    async with httpx.AsyncClient(base_url=shared_retriever.url, timeout=120.0) as http:

        async def ingest(text: str) -> httpx.Response:
            return await http.post("/v1/documents", json={"text": text})

        async def search(i: int) -> httpx.Response:
            return await http.post(
                "/v1/search", json={"query": f"beacon on hill {i % NUM_DOCS}", "top_k": 5}
            )

        # The same document twice at once must still be stored once.
        jobs = [ingest(t) for t in texts] + [ingest(texts[0])]
        jobs += [search(i) for i in range(NUM_SEARCHES)]
        responses = await asyncio.gather(*jobs)
        assert all(r.status_code == 200 for r in responses), [
            r.text for r in responses if r.status_code != 200
        ]

        ingested = [r.json() for r in responses[: NUM_DOCS + 1]]
        assert ingested[0]["chunk_ids"] == ingested[-1]["chunk_ids"]
        assert sorted(r["status"] for r in (ingested[0], ingested[-1])) == ["created", "unchanged"]
        for body in ingested[:NUM_DOCS]:
            detail = (await http.get(f"/v1/documents/{body['doc_id']}")).json()
            assert [c["chunk_id"] for c in detail["chunks"]] == body["chunk_ids"]
            found = (
                await http.post(
                    "/v1/search",
                    json={"query": "beacon oil", "top_k": 50, "doc_ids": [body["doc_id"]]},
                )
            ).json()
            assert len(found["results"]) == len(set(body["chunk_ids"]))
        health = (await http.get("/health")).json()
        assert health["index_vectors"] == health["chunks"]
