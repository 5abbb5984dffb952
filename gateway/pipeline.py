"""The query path: retrieve the chunks of a question, then stream a generation over them from
the engine pool, timing each stage into the metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from common.contract import Delta
from gateway.clients.engine import EnginePool, EngineStream
from gateway.clients.retriever import RetrieverClient
from gateway.errors import GatewayDependencyError
from gateway.metrics import GatewayMetrics
from gateway.tenancy import collection_salt
from gateway.types import EngineRequest, EngineResult, RagRequest, Source


class TimedStream:
    """An engine stream over a request's retrieved sources (`generation`) that records the
    first token's time (from `arrived_at`, the request's arrival) and the generation's usage
    once the result arrives."""

    def __init__(
        self,
        stream: EngineStream,
        generation: EngineRequest,
        metrics: GatewayMetrics,
        arrived_at: float,
        sent_at: float,
        retrieval_s: float,
    ):
        self.stream = stream
        self.generation = generation
        self.metrics = metrics
        self.arrived_at = arrived_at
        self.sent_at = sent_at
        self.retrieval_s = retrieval_s  # how long the search for its sources took
        self.ttft_s: float | None = None
        # Set when the stream broke off after it began: the client got a 200 and an error event.
        self.failure: GatewayDependencyError | None = None

    @property
    def engine(self) -> str:
        """The name of the engine serving it ("engine-0"…)."""
        return self.stream.engine.name

    async def events(self) -> AsyncIterator[Delta | EngineResult]:
        try:
            async for event in self.stream.events():
                now = time.perf_counter()
                if self.ttft_s is None and (isinstance(event, EngineResult) or event.text):
                    self.ttft_s = now - self.arrived_at
                    self.metrics.ttft.labels(self.generation.mode).observe(self.ttft_s)
                if isinstance(event, EngineResult):
                    self.metrics.observe_generation(
                        self.generation.mode, event.usage, now - self.sent_at
                    )
                yield event
        except GatewayDependencyError as exc:
            self.failure = exc
            raise

    async def collect(self) -> EngineResult:
        async for event in self.events():
            if isinstance(event, EngineResult):
                return event
        raise AssertionError("EngineStream.events ends with an EngineResult or raises")


class Pipeline:
    def __init__(self, retriever: RetrieverClient, engines: EnginePool, metrics: GatewayMetrics):
        self.retriever = retriever
        self.engines = engines
        self.metrics = metrics

    @asynccontextmanager
    async def start(
        self, rag: RagRequest, *, request_id: str, arrived_at: float
    ) -> AsyncIterator[TimedStream]:
        """Chunk the request's passages and retrieve its chunks (best first, then the second
        hop's), then open an engine stream over them; leaving the context early cancels the
        engine's work."""
        started = time.perf_counter()
        sources = await self._sources(rag, request_id)
        retrieval_s = time.perf_counter() - started
        generation = EngineRequest(rag, tuple(sources))
        sent_at = time.perf_counter()
        async with self.engines.generate(generation, request_id=request_id) as stream:
            self.metrics.engine_requests.labels(stream.engine.name).inc()
            yield TimedStream(stream, generation, self.metrics, arrived_at, sent_at, retrieval_s)

    async def _sources(self, rag: RagRequest, request_id: str) -> list[Source]:
        """The request's own passages chunked, then what the search finds (unless retrieval
        is "none"), each with the cache salt of its scope."""
        sources: list[Source] = []
        if rag.passages:
            sources += await self.retriever.chunk_passages(
                rag.passages, rag.cache_salt, request_id=request_id
            )
        if rag.retrieve:
            searched = time.perf_counter()
            found = await self.retriever.search(rag.search(), request_id=request_id)
            self.metrics.retrieval_seconds.observe(time.perf_counter() - searched)
            if rag.collection_salts:
                found = [replace(s, cache_salt=collection_salt(s.collection)) for s in found]
            sources += found
        return sources
