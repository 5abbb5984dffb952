"""Prometheus metrics of the retriever, all prefixed `ragblend_retriever_`, on a registry of
their own so that several apps in one process never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from retriever.service import Stats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RetrieverMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.search_latency_s = Histogram(
            "ragblend_retriever_search_latency_seconds",
            "Time to answer one search",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ingest_latency_s = Histogram(
            "ragblend_retriever_ingest_latency_seconds",
            "Time to ingest one document",
            buckets=_LATENCY_BUCKETS_S + (30.0, 60.0, 300.0),
            registry=r,
        )
        self.documents_ingested = Counter(
            "ragblend_retriever_documents_ingested",
            "Documents stored (created or replaced)",
            registry=r,
        )
        self.chunks_ingested = Counter(
            "ragblend_retriever_chunks_ingested", "Chunks stored", registry=r
        )
        self.documents_unchanged = Counter(
            "ragblend_retriever_documents_unchanged",
            "Ingests of a document already stored with the same text",
            registry=r,
        )
        self.documents_deleted = Counter(
            "ragblend_retriever_documents_deleted", "Documents deleted", registry=r
        )
        self.ingest_failures = Counter(
            "ragblend_retriever_ingest_failures",
            "Rejected ingests, by reason",
            ["reason"],
            registry=r,
        )
        self.documents = Gauge("ragblend_retriever_documents", "Documents stored", registry=r)
        self.chunks = Gauge("ragblend_retriever_chunks", "Chunks stored", registry=r)
        self.index_vectors = Gauge(
            "ragblend_retriever_index_vectors", "Live vectors in the FAISS index", registry=r
        )

    def render(self, stats: Stats) -> bytes:
        """The text exposition, with the size gauges read at scrape time."""
        self.documents.set(stats.documents)
        self.chunks.set(stats.chunks)
        self.index_vectors.set(stats.index_vectors)
        return generate_latest(self.registry)
