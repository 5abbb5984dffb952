"""The retriever's domain: ingest, search, delete and list documents over the catalog
(truth) and the vector index (cache); no HTTP here."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from retriever.catalog import Catalog, ChunkRecord, DocumentRecord
from retriever.chunking import OffsetTokenizer, chunk_text, content_hash
from retriever.embeddings import Embedder
from retriever.index import IndexParams, VectorIndex, load_index, write_atomic
from retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

# Past this share of dead HNSW entries, searches waste most of their beam on them.
HNSW_REBUILD_TOMBSTONE_FRACTION = 0.25
CATALOG_FILE = "catalog.sqlite3"
INDEX_FILE = "index.faiss"


class EmptyDocumentError(ValueError):
    """The document has no text to index."""


class UnknownDocumentError(KeyError):
    """No document has this id."""

    def __init__(self, doc_ids: list[str]):
        super().__init__(doc_ids)
        self.doc_ids = doc_ids

    def __str__(self) -> str:
        return "unknown doc_id " + ", ".join(repr(d) for d in self.doc_ids)


@dataclass(frozen=True)
class DocumentInput:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    doc_id: str | None = None


@dataclass(frozen=True)
class IngestResult:
    doc_id: str
    chunk_ids: list[str]
    # created: new document; replaced: same id, new text; unchanged: same id and text.
    status: Literal["created", "replaced", "unchanged"]
    num_tokens: int


@dataclass(frozen=True)
class SearchHit:
    chunk_id: str
    doc_id: str
    score: float
    text: str


@dataclass(frozen=True)
class Stats:
    documents: int
    chunks: int
    index_vectors: int


def load_tokenizer(settings: RetrieverSettings, embedder: Embedder) -> OffsetTokenizer:
    """The LLM tokenizer named in the settings, else (logged) the embedding model's own."""
    if settings.tokenizer is None:
        logger.info(
            "no tokenizer configured (RAGBLEND_RETRIEVER_TOKENIZER): chunking with the "
            "embedding model's tokenizer (%s)",
            embedder.info.model,
        )
        return embedder.tokenizer_copy()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {settings.tokenizer!r} has no fast version with offsets")
    logger.info("chunking with tokenizer %s", settings.tokenizer)
    return tokenizer


class RetrieverService:
    """Thread-safe: writers are serialised by one lock, searches run alongside them."""

    def __init__(self, settings: RetrieverSettings, embedder: Embedder, tokenizer: OffsetTokenizer):
        self.settings = settings
        self.embedder = embedder
        self._tokenizer = tokenizer
        self._chunk_lock = threading.Lock()  # the tokenizer is not safe to share between threads
        self._write_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._dirty = False
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(settings.data_dir / CATALOG_FILE)
        self.catalog.bind_embedding_model(embedder.info.model, embedder.info.dim)
        self._params = IndexParams(
            kind=settings.index,
            dim=embedder.info.dim,
            hnsw_m=settings.hnsw_m,
            hnsw_ef_construction=settings.hnsw_ef_construction,
            hnsw_ef_search=settings.hnsw_ef_search,
        )
        self.index = self._open_index()

    @classmethod
    def open(cls, settings: RetrieverSettings) -> RetrieverService:
        """Load the model, the tokenizer, the catalog and the index (slow: seconds)."""
        embedder = Embedder(settings.embedding_model, settings.device, settings.embed_batch_size)
        if settings.chunk_tokens > embedder.info.max_seq_tokens:
            logger.info(
                "chunks (%d tokens) may exceed the embedding model's %d-token window: long "
                "chunks are embedded window by window and averaged",
                settings.chunk_tokens,
                embedder.info.max_seq_tokens,
            )
        return cls(settings, embedder, load_tokenizer(settings, embedder))

    # -- index cache ------------------------------------------------------------------------

    def _open_index(self) -> VectorIndex:
        path = self.settings.data_dir / INDEX_FILE
        generation = self.catalog.generation()
        loaded = load_index(path, self._params)
        if loaded is not None and loaded[1] == generation:
            logger.info("index %s is current (generation %d)", path, generation)
            return loaded[0]
        if loaded is None:
            index = self._build_index(None)
        else:
            index = loaded[0]
            self._reconcile(index)
        self._dirty = True
        return index

    def _build_index(self, rowids: np.ndarray | None) -> VectorIndex:
        index = VectorIndex(self._params)
        for ids, vectors in self.catalog.embeddings(rowids, self._params.dim):
            index.add(ids, vectors)
        logger.info(
            "built %s index of %d vectors from the catalog", self._params.kind, index.num_vectors
        )
        return index

    def _reconcile(self, index: VectorIndex) -> None:
        """Make the index hold exactly the catalog's chunks: the catalog is the truth."""
        in_catalog = self.catalog.rowids()
        in_index = index.ids()
        extra = np.setdiff1d(in_index, in_catalog)
        missing = np.setdiff1d(in_catalog, in_index)
        index.remove(extra)
        for ids, vectors in self.catalog.embeddings(missing, self._params.dim):
            index.add(ids, vectors)
        logger.info(
            "index reconciled with the catalog: %d added, %d removed", len(missing), len(extra)
        )

    def save_index(self, force: bool = False) -> bool:
        """Persist the index if it changed since the last save; True when it wrote."""
        with self._save_lock:
            with self._write_lock:
                if not (self._dirty or force):
                    return False
                # Snapshot under the write lock so the generation matches the vectors.
                data = self.index.to_bytes(self.catalog.generation())
                self._dirty = False
            try:
                write_atomic(self.settings.data_dir / INDEX_FILE, data)
            except OSError:
                self._dirty = True
                raise
        return True

    # -- writes -----------------------------------------------------------------------------

    def ingest(self, doc: DocumentInput) -> IngestResult:
        """Chunk, embed and store one document; all of it or nothing is committed.

        Raises EmptyDocumentError when the text has no content.
        """
        if not doc.text.strip():
            raise EmptyDocumentError("document text is empty")
        sha = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        doc_id = doc.doc_id or content_hash(doc.text)
        unchanged = self._unchanged(doc_id, sha, doc.metadata)
        if unchanged is not None:
            return unchanged
        with self._chunk_lock:
            pieces = chunk_text(
                doc.text,
                self._tokenizer,
                self.settings.chunk_tokens,
                self.settings.chunk_overlap_tokens,
            )
        if not pieces:
            raise EmptyDocumentError("document text has no tokens")
        # Embedding is the slow part; it runs outside the write lock so deletes and other
        # documents' commits are not held up behind it.
        vectors = self.embedder.encode([p.text for p in pieces])
        records = [
            ChunkRecord(p.chunk_id, i, p.text, p.num_tokens, p.start_char, p.end_char)
            for i, p in enumerate(pieces)
        ]
        with self._write_lock:
            # Another request may have stored the same document while this one embedded.
            unchanged = self._unchanged(doc_id, sha, doc.metadata)
            if unchanged is not None:
                return unchanged
            existed = self.catalog.get_document(doc_id) is not None
            result = self.catalog.put_document(
                doc_id, sha, doc.metadata, len(doc.text), records, vectors
            )
            # The commit above is the point of no return; a crash before the index catches
            # up is repaired by reconciliation at the next start.
            self.index.remove(result.removed_rowids)
            self.index.add(result.added_rowids, vectors)
            self._dirty = True
            self._maybe_rebuild()
        return IngestResult(
            doc_id,
            [r.chunk_id for r in records],
            "replaced" if existed else "created",
            sum(r.num_tokens for r in records),
        )

    def _unchanged(self, doc_id: str, sha: str, metadata: dict[str, Any]) -> IngestResult | None:
        existing = self.catalog.get_document(doc_id)
        if existing is None or existing.content_sha256 != sha:
            return None
        if metadata and metadata != existing.metadata:
            self.catalog.update_metadata(doc_id, metadata)
        chunk_ids = [c.chunk_id for c in self.catalog.document_chunks(doc_id)]
        return IngestResult(doc_id, chunk_ids, "unchanged", existing.num_tokens)

    def delete(self, doc_id: str) -> int:
        """Remove a document, its chunks and vectors; returns the number of chunks removed.

        Raises UnknownDocumentError when no document has this id.
        """
        with self._write_lock:
            result = self.catalog.delete_document(doc_id)
            if result is None:
                raise UnknownDocumentError([doc_id])
            self.index.remove(result.removed_rowids)
            self._dirty = True
            self._maybe_rebuild()
        return len(result.removed_rowids)

    def _maybe_rebuild(self) -> None:
        if self.index.tombstone_fraction > HNSW_REBUILD_TOMBSTONE_FRACTION:
            logger.info(
                "rebuilding the HNSW index: %.0f%% tombstones", 100 * self.index.tombstone_fraction
            )
            self.index = self._build_index(None)

    # -- reads ------------------------------------------------------------------------------

    def search(
        self,
        query: str,
        top_k: int,
        doc_ids: list[str] | None = None,
        min_score: float | None = None,
    ) -> list[SearchHit]:
        """The `top_k` chunks most similar to `query`, best first.

        Raises ValueError for an empty query or top_k outside [1, max_top_k], and
        UnknownDocumentError when `doc_ids` names a document that does not exist.
        """
        if not query.strip():
            raise ValueError("query is empty")
        if not 1 <= top_k <= self.settings.max_top_k:
            raise ValueError(f"top_k must be between 1 and {self.settings.max_top_k}")
        allowed = None
        if doc_ids is not None:
            missing = self.catalog.missing_documents(doc_ids)
            if missing:
                raise UnknownDocumentError(missing)
            allowed = self.catalog.rowids(doc_ids)
            if len(allowed) == 0:
                return []
        vector = self.embedder.encode([query])
        index = self.index
        # Fetch a few extra: a hit may vanish (deleted meanwhile) or repeat a chunk text.
        k = min(top_k + 8, max(1, index.num_vectors))
        scores, ids = index.search(vector, k, allowed)
        found = self.catalog.chunks_by_rowid([int(i) for i in ids[0] if i >= 0])
        hits: list[SearchHit] = []
        seen: set[tuple[str, str]] = set()
        for score, rowid in zip(scores[0], ids[0], strict=True):
            chunk = found.get(int(rowid))
            if chunk is None or (chunk.doc_id, chunk.chunk_id) in seen:
                continue
            if min_score is not None and score < min_score:
                break
            seen.add((chunk.doc_id, chunk.chunk_id))
            hits.append(SearchHit(chunk.chunk_id, chunk.doc_id, float(score), chunk.text))
            if len(hits) == top_k:
                break
        return hits

    def get_document(self, doc_id: str) -> tuple[DocumentRecord, list[ChunkRecord]]:
        """A document and its chunks; raises UnknownDocumentError when there is none."""
        record = self.catalog.get_document(doc_id)
        if record is None:
            raise UnknownDocumentError([doc_id])
        return record, self.catalog.document_chunks(doc_id)

    def list_documents(self, limit: int = 1000, offset: int = 0) -> list[DocumentRecord]:
        return self.catalog.list_documents(limit, offset)

    def stats(self) -> Stats:
        documents, chunks = self.catalog.counts()
        return Stats(documents, chunks, self.index.num_vectors)

    def close(self) -> None:
        """Save the index so that the next start needs no rebuild."""
        started = time.perf_counter()
        if self.save_index():
            logger.info("index saved in %.2f s", time.perf_counter() - started)
