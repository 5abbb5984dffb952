"""Background precompute of newly ingested documents, on every engine or, when the engines
share a KV tier, each chunk on one of them; a status per document (pending, ready, failed)
that clients poll."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from common.contract import ChunkIn, PrecomputeRequest
from gateway.clients.engine import EnginePool, EngineState
from gateway.clients.retriever import RetrieverClient
from gateway.errors import GatewayDependencyError
from gateway.metrics import GatewayMetrics
from gateway.tenancy import UNSCOPED, CacheScope

log = logging.getLogger(__name__)


DocKey = tuple[str, str]  # (collection, doc_id): ids are unique within a collection


@dataclass
class IngestStatus:
    collection: str
    doc_id: str
    status: str = "pending"  # pending -> ready | failed
    error: str | None = None
    # engine name -> "stored N, skipped M" | error
    engines: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> DocKey:
        return (self.collection, self.doc_id)


class IngestTracker:
    """Without a shared KV tier, precomputes on all engines, not on one chosen by hashing:
    queries are routed by the hash of the retrieved chunk *set*, which mixes documents, so no
    single engine can be predicted for a document. Every engine holding every chunk keeps any
    routing warm; the cost is N background precomputes, which engines run between generations.

    When every engine reports `shared_kv` (a remote tier they all read and write), a chunk
    precomputed once is found by every engine, so each chunk goes to one engine only: the
    first healthy one of the rendezvous ranking of that chunk's id (which spreads a document's
    chunks over the pool and sends a re-ingested chunk to the engine that already holds it),
    and the next one of its ranking when that engine's call fails."""

    def __init__(
        self,
        retriever: RetrieverClient,
        engines: EnginePool,
        metrics: GatewayMetrics,
        scope: CacheScope | None = None,
    ):
        self.retriever = retriever
        self.engines = engines
        self.metrics = metrics
        # A chunk's KV is stored under its collection's salt, which retrieval gives it again.
        self.scope = scope or UNSCOPED
        self._statuses: dict[DocKey, IngestStatus] = {}
        self._tasks: dict[DocKey, asyncio.Task] = {}

    def status(self, collection: str, doc_id: str) -> IngestStatus | None:
        """None when this gateway process has not ingested the document."""
        return self._statuses.get((collection, doc_id))

    def start(self, collection: str, doc_id: str, *, request_id: str) -> IngestStatus:
        status = IngestStatus(collection, doc_id)
        previous = self._tasks.pop(status.key, None)
        if previous is not None:
            previous.cancel()  # a re-ingest replaces the chunks the old task was storing
        self._statuses[status.key] = status
        self._tasks[status.key] = asyncio.create_task(self._run(status, request_id))
        return status

    def forget(self, collection: str, doc_id: str) -> None:
        task = self._tasks.pop((collection, doc_id), None)
        if task is not None:
            task.cancel()
        self._statuses.pop((collection, doc_id), None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, status: IngestStatus, request_id: str) -> None:
        try:
            await self._precompute(status, request_id)
        finally:
            if self._tasks.get(status.key) is asyncio.current_task():
                del self._tasks[status.key]

    async def _precompute(self, status: IngestStatus, request_id: str) -> None:
        try:
            document = await self.retriever.get_document(
                status.collection, status.doc_id, request_id=request_id
            )
            salt = self.scope.collection_salt(status.collection)
            chunks = [
                ChunkIn(id=c["chunk_id"], text=c["text"], cache_salt=salt)
                for c in document["chunks"]
            ]
            if self.engines.shared_kv:
                await self._precompute_once(status, chunks, request_id)
                return
            results = await asyncio.gather(
                *(
                    self.engines.precompute(
                        engine, PrecomputeRequest(chunks=chunks), request_id=request_id
                    )
                    for engine in self.engines.engines
                ),
                return_exceptions=True,
            )
        except GatewayDependencyError as exc:
            self._finish(status, "failed", str(exc))
            return
        ok = 0
        for engine, result in zip(self.engines.engines, results, strict=True):
            if isinstance(result, GatewayDependencyError):
                status.engines[engine.name] = f"failed: {result}"
            elif isinstance(result, BaseException):
                raise result
            else:
                ok += 1
                stored, skipped = result.stored, result.skipped
                status.engines[engine.name] = f"stored {stored}, skipped {skipped}"
        # One engine is enough to call it ready: an engine that missed the precompute computes
        # those chunks in full on first use and stores them then (docs/design.md, "A chunk
        # without KV").
        if ok:
            self._finish(status, "ready", None)
        else:
            self._finish(status, "failed", "precompute failed on every engine")

    async def _precompute_once(
        self, status: IngestStatus, chunks: list[ChunkIn], request_id: str
    ) -> None:
        """Each chunk on the first engine of its ranking that stores it; the document is ready
        when every chunk was stored (or found) on one engine."""
        rankings = {c.id: self.engines.candidates([c.id]) for c in chunks}
        pending = {c.id: c for c in chunks}
        tried: dict[str, int] = dict.fromkeys(pending, 0)
        counts: dict[str, list[int]] = {}  # engine name -> [stored, skipped]
        while pending:
            groups: dict[str, tuple[EngineState, list[ChunkIn]]] = {}
            for chunk_id, chunk in list(pending.items()):
                ranking = rankings[chunk_id]
                if tried[chunk_id] >= len(ranking):
                    del pending[chunk_id]  # every engine failed it
                    continue
                engine = ranking[tried[chunk_id]]
                groups.setdefault(engine.name, (engine, []))[1].append(chunk)
            if not groups:
                break
            results = await asyncio.gather(
                *(
                    self.engines.precompute(
                        engine, PrecomputeRequest(chunks=group), request_id=request_id
                    )
                    for engine, group in groups.values()
                ),
                return_exceptions=True,
            )
            for (engine, group), result in zip(groups.values(), results, strict=True):
                if isinstance(result, GatewayDependencyError):
                    status.engines[engine.name] = f"failed: {result}"
                    for chunk in group:
                        tried[chunk.id] += 1
                    continue
                if isinstance(result, BaseException):
                    raise result
                total = counts.setdefault(engine.name, [0, 0])
                total[0] += result.stored
                total[1] += result.skipped
                status.engines[engine.name] = f"stored {total[0]}, skipped {total[1]}"
                for chunk in group:
                    del pending[chunk.id]
        missed = sum(1 for chunk_id in tried if tried[chunk_id] >= len(rankings[chunk_id]))
        if missed:
            # Those chunks are computed in full on first use and stored then.
            self._finish(
                status, "failed", f"{missed} of {len(chunks)} chunks failed on every engine"
            )
        else:
            self._finish(status, "ready", None)

    def _finish(self, status: IngestStatus, state: str, error: str | None) -> None:
        status.status, status.error = state, error
        self.metrics.documents.labels(state).inc()
        log.info(
            "document %s/%s precompute %s%s",
            status.collection,
            status.doc_id,
            state,
            f": {error}" if error else "",
        )
