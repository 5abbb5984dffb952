"""Background precompute of newly ingested documents on every engine, with a status per
document (pending, ready, failed) that clients poll."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.clients.engine import EnginePool
from gateway.clients.retriever import RetrieverClient
from gateway.errors import GatewayDependencyError
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass
class IngestStatus:
    doc_id: str
    status: str = "pending"  # pending -> ready | failed
    error: str | None = None
    engines: dict[str, str] = field(default_factory=dict)  # url -> "stored N, skipped M" | error


class IngestTracker:
    """Precomputes on all engines, not on one chosen by hashing: queries are routed by the hash
    of the retrieved chunk *set*, which mixes documents, so no single engine can be predicted
    for a document. Every engine holding every chunk keeps any routing warm; the cost is N
    background precomputes, which engines run between generations."""

    def __init__(self, retriever: RetrieverClient, engines: EnginePool, metrics: GatewayMetrics):
        self.retriever = retriever
        self.engines = engines
        self.metrics = metrics
        self._statuses: dict[str, IngestStatus] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def status(self, doc_id: str) -> IngestStatus | None:
        """None when this gateway process has not ingested the document."""
        return self._statuses.get(doc_id)

    def start(self, doc_id: str, *, request_id: str) -> IngestStatus:
        previous = self._tasks.pop(doc_id, None)
        if previous is not None:
            previous.cancel()  # a re-ingest replaces the chunks the old task was storing
        status = IngestStatus(doc_id)
        self._statuses[doc_id] = status
        self._tasks[doc_id] = asyncio.create_task(self._run(status, request_id))
        return status

    def forget(self, doc_id: str) -> None:
        task = self._tasks.pop(doc_id, None)
        if task is not None:
            task.cancel()
        self._statuses.pop(doc_id, None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, status: IngestStatus, request_id: str) -> None:
        try:
            await self._precompute(status, request_id)
        finally:
            if self._tasks.get(status.doc_id) is asyncio.current_task():
                del self._tasks[status.doc_id]

    async def _precompute(self, status: IngestStatus, request_id: str) -> None:
        try:
            document = await self.retriever.get_document(status.doc_id, request_id=request_id)
            chunks = [{"id": c["chunk_id"], "text": c["text"]} for c in document["chunks"]]
            results = await asyncio.gather(
                *(
                    self.engines.precompute(url, chunks, request_id=request_id)
                    for url in self.engines.urls
                ),
                return_exceptions=True,
            )
        except GatewayDependencyError as exc:
            self._finish(status, "failed", str(exc))
            return
        ok = 0
        for url, result in zip(self.engines.urls, results, strict=True):
            if isinstance(result, GatewayDependencyError):
                status.engines[url] = f"failed: {result}"
            elif isinstance(result, BaseException):
                raise result
            else:
                ok += 1
                status.engines[url] = f"stored {result['stored']}, skipped {result['skipped']}"
        # One engine is enough to call it ready: an engine that missed the precompute computes
        # those chunks in full on first use and stores them then (DESIGN.md section 3, step 4).
        if ok:
            self._finish(status, "ready", None)
        else:
            self._finish(status, "failed", "precompute failed on every engine")

    def _finish(self, status: IngestStatus, state: str, error: str | None) -> None:
        status.status, status.error = state, error
        self.metrics.documents.labels(state).inc()
        log.info("document %s precompute %s%s", status.doc_id, state, f": {error}" if error else "")
