"""The retriever's domain: ingest, search, delete and list documents over the catalog
(truth) and the vector index (cache); no HTTP here."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from common.contract import MAX_HOPS
from common.validation import DEFAULT_COLLECTION
from retriever.bm25 import match_expression
from retriever.catalog import Catalog, ChunkRecord, DocumentRecord
from retriever.chunking import Chunk, OffsetTokenizer, chunk_text, content_hash
from retriever.embeddings import Embedder
from retriever.fusion import RETRIEVAL_MODES, RetrievalMode, reciprocal_rank_fusion
from retriever.hops import MAX_HOP_ENTITIES, entities, second_hop_query
from retriever.index import IndexParams, VectorIndex, load_index, write_atomic
from retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

# Past this share of dead HNSW entries, searches waste most of their beam on them.
HNSW_REBUILD_TOMBSTONE_FRACTION = 0.25
CATALOG_FILE = "catalog.sqlite3"
INDEX_FILE = "index.faiss"
# Candidates each ranking brings to a hybrid fusion: a chunk ranked low by one retriever and
# high by the other must still be in both lists to be fused.
MIN_FUSION_CANDIDATES = 30


class EmptyDocumentError(ValueError):
    """The document has no text to index."""


class DocumentTooLargeError(ValueError):
    """The document is longer than a per-document limit; the message names the setting."""


class UnknownDocumentError(KeyError):
    """No document has this id (in the collections searched)."""

    def __init__(self, doc_ids: list[str], collections: list[str] | None):
        super().__init__(doc_ids)
        self.doc_ids = doc_ids
        self.collections = collections

    def __str__(self) -> str:
        where = ""
        if self.collections is not None:
            where = " in collection " + ", ".join(repr(c) for c in self.collections)
        return "unknown doc_id " + ", ".join(repr(d) for d in self.doc_ids) + where


@dataclass(frozen=True)
class DocumentInput:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    doc_id: str | None = None
    collection: str = DEFAULT_COLLECTION


@dataclass(frozen=True)
class IngestResult:
    collection: str
    doc_id: str
    chunk_ids: list[str]
    # created: new document; replaced: same id, new text; unchanged: same id and text.
    status: Literal["created", "replaced", "unchanged"]
    num_tokens: int


@dataclass(frozen=True)
class SearchHit:
    chunk_id: str
    collection: str
    doc_id: str
    # dense: cosine similarity; bm25: -BM25 (higher is better); hybrid: the RRF score.
    score: float
    text: str
    num_tokens: int
    hop: int = 1  # 2: found by the second hop


@dataclass(frozen=True)
class _Scope:
    """Where a search looks: allowed rowids for the index, the filters for BM25's SQL."""

    collections: list[str] | None
    doc_ids: list[str] | None
    allowed: np.ndarray | None


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
        # Set at shutdown: an ingest still embedding gives up instead of holding the process.
        self._stopping = threading.Event()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(settings.data_dir / CATALOG_FILE)
        self.catalog.bind_embedding_model(embedder.info.model, embedder.info.dim)
        self._params = IndexParams.from_settings(settings, embedder.info.dim)
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

        Raises EmptyDocumentError when the text has no content, DocumentTooLargeError when it
        exceeds max_document_chars or max_chunks_per_document (checked before embedding).
        """
        if not doc.text.strip():
            raise EmptyDocumentError("document text is empty")
        if len(doc.text) > self.settings.max_document_chars:
            raise DocumentTooLargeError(
                f"document text has more than max_document_chars "
                f"({self.settings.max_document_chars}) characters"
            )
        sha = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        doc_id = doc.doc_id or content_hash(doc.text)
        key = (doc.collection, doc_id)
        unchanged = self._unchanged(key, sha, doc.metadata)
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
        if len(pieces) > self.settings.max_chunks_per_document:
            raise DocumentTooLargeError(
                f"document splits into {len(pieces)} chunks, above max_chunks_per_document "
                f"({self.settings.max_chunks_per_document})"
            )
        # Embedding is the slow part; it runs outside the write lock so deletes and other
        # documents' commits are not held up behind it.
        vectors = self.embedder.encode([p.text for p in pieces], self._stopping.is_set)
        records = [
            ChunkRecord(p.chunk_id, i, p.text, p.num_tokens, p.start_char, p.end_char)
            for i, p in enumerate(pieces)
        ]
        with self._write_lock:
            # Another request may have stored the same document while this one embedded.
            unchanged = self._unchanged(key, sha, doc.metadata)
            if unchanged is not None:
                return unchanged
            existed = self.catalog.get_document(*key) is not None
            result = self.catalog.put_document(
                *key, sha, doc.metadata, len(doc.text), records, vectors
            )
            # The commit above is the point of no return; a crash before the index catches
            # up is repaired by reconciliation at the next start.
            self.index.remove(result.removed_rowids)
            self.index.add(result.added_rowids, vectors)
            self._dirty = True
            self._maybe_rebuild()
        return IngestResult(
            doc.collection,
            doc_id,
            [r.chunk_id for r in records],
            "replaced" if existed else "created",
            sum(r.num_tokens for r in records),
        )

    def _unchanged(
        self, key: tuple[str, str], sha: str, metadata: dict[str, Any]
    ) -> IngestResult | None:
        existing = self.catalog.get_document(*key)
        if existing is None or existing.content_sha256 != sha:
            return None
        if metadata and metadata != existing.metadata:
            self.catalog.update_metadata(*key, metadata)
        chunk_ids = [c.chunk_id for c in self.catalog.document_chunks(*key)]
        return IngestResult(*key, chunk_ids, "unchanged", existing.num_tokens)

    def chunk(self, text: str) -> list[Chunk]:
        """`text` split as `ingest` splits a document (chunk_tokens, chunk_overlap_tokens),
        stored nowhere: a request's own passages are chunked like ingested documents."""
        with self._chunk_lock:
            return chunk_text(
                text,
                self._tokenizer,
                self.settings.chunk_tokens,
                self.settings.chunk_overlap_tokens,
            )

    def delete(self, collection: str, doc_id: str) -> int:
        """Remove a document, its chunks and vectors; returns the number of chunks removed.

        Raises UnknownDocumentError when the collection has no document of this id.
        """
        with self._write_lock:
            result = self.catalog.delete_document(collection, doc_id)
            if result is None:
                raise UnknownDocumentError([doc_id], [collection])
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
        collections: list[str] | None = None,
        retrieval: RetrievalMode | None = None,
        hops: int = 1,
    ) -> list[SearchHit]:
        """The `top_k` chunks best matching `query` in `collections` (None: all), best first,
        by `retrieval` (None: the `retrieval` setting). With `hops=2`, up to `top_k` more
        follow: chunks found by searching for the names the first ones mention (see
        retriever.hops), none repeated. A query longer than the embedding model's window is
        truncated to it for dense search; BM25 reads its first words (retriever.bm25).

        `min_score` is a cosine similarity: dense and hybrid results below it are left out;
        with bm25 it is an error. Raises ValueError for an empty query, top_k outside
        [1, max_top_k], hops outside [1, 2], an unknown retrieval mode or min_score with bm25,
        and UnknownDocumentError when `doc_ids` names a document that those collections lack.
        """
        if not query.strip():
            raise ValueError("query is empty")
        if not 1 <= top_k <= self.settings.max_top_k:
            raise ValueError(f"top_k must be between 1 and {self.settings.max_top_k}")
        if not 1 <= hops <= MAX_HOPS:
            raise ValueError(f"hops must be between 1 and {MAX_HOPS}")
        mode = retrieval or self.settings.retrieval
        if mode not in RETRIEVAL_MODES:
            raise ValueError(f"retrieval must be one of {', '.join(RETRIEVAL_MODES)}")
        if min_score is not None and mode == "bm25":
            raise ValueError("min_score is a cosine similarity: use it with dense or hybrid")
        if collections is not None and self.catalog.collections() <= set(collections):
            collections = None  # every collection that has documents: no filter needed
        allowed = None
        if doc_ids is not None:
            missing = self.catalog.missing_documents(doc_ids, collections)
            if missing:
                raise UnknownDocumentError(missing, collections)
        if doc_ids is not None or collections is not None:
            allowed = self.catalog.rowids(collections, doc_ids)
            if len(allowed) == 0:
                return []
        scope = _Scope(collections, doc_ids, allowed)
        first = self._search_once(query, top_k, mode, scope, min_score, set())
        if hops == 1 or not first:
            return first
        return first + self._second_hop(query, first, top_k, mode, scope, min_score)

    def _second_hop(
        self,
        query: str,
        first: list[SearchHit],
        top_k: int,
        mode: RetrievalMode,
        scope: _Scope,
        min_score: float | None,
    ) -> list[SearchHit]:
        """Up to top_k new chunks: one search per name in the first hop's chunks (at most
        top_k names), their results taken in turn (the best new chunk of each name, then the
        second best...), so the names of the best first-hop chunk come first."""
        seen = {_hit_key(h) for h in first}
        names = entities(query, [h.text for h in first], min(top_k, MAX_HOP_ENTITIES))
        rounds = [
            self._search_once(second_hop_query(query, name), top_k, mode, scope, min_score, seen)
            for name in names
        ]
        found: list[SearchHit] = []
        for rank in range(top_k):
            for hits in rounds:
                if rank < len(hits) and _hit_key(hits[rank]) not in seen:
                    seen.add(_hit_key(hits[rank]))
                    found.append(hits[rank])
        return [dataclasses.replace(h, hop=2) for h in found[:top_k]]

    def _search_once(
        self,
        query: str,
        top_k: int,
        mode: RetrievalMode,
        scope: _Scope,
        min_score: float | None,
        skip: set[tuple[str, str, str]],
    ) -> list[SearchHit]:
        """One search: up to top_k hits, best first, leaving out the chunks in `skip`."""
        # Fetch a few extra: a hit may vanish (deleted meanwhile), repeat a chunk text or be
        # skipped.
        depth = top_k + 8 + len(skip)
        dense: list[tuple[int, float]] = []
        lexical: list[tuple[int, float]] = []
        vector = None
        if mode != "bm25":
            vector = self.embedder.encode_query(query)
            dense_depth = depth if mode == "dense" else max(depth, MIN_FUSION_CANDIDATES)
            dense = self._dense(vector, dense_depth, scope.allowed)
        if mode != "dense":
            lexical = self._lexical(query, max(depth, MIN_FUSION_CANDIDATES), scope)
        if mode == "dense":
            ranked = dense
        elif mode == "bm25":
            ranked = lexical
        else:
            ranked = reciprocal_rank_fusion(
                [[i for i, _ in dense], [i for i, _ in lexical]], self.settings.rrf_k
            )
        found = self.catalog.chunks_by_rowid([rowid for rowid, _ in ranked])
        similarity = dict(dense)
        if min_score is not None and mode == "hybrid":
            assert vector is not None
            similarity |= self._similarities(vector, [i for i, _ in ranked if i not in similarity])
        hits: list[SearchHit] = []
        taken = set(skip)
        for rowid, score in ranked:
            chunk = found.get(rowid)
            if chunk is None:
                continue
            key = (chunk.collection, chunk.doc_id, chunk.chunk_id)
            if key in taken:
                continue
            if min_score is not None and similarity[rowid] < min_score:
                if mode == "dense":
                    break  # best first: the rest is below too
                continue
            taken.add(key)
            hits.append(
                SearchHit(
                    chunk.chunk_id,
                    chunk.collection,
                    chunk.doc_id,
                    float(score),
                    chunk.text,
                    chunk.num_tokens,
                )
            )
            if len(hits) == top_k:
                break
        return hits

    def _dense(
        self, vector: np.ndarray, depth: int, allowed: np.ndarray | None
    ) -> list[tuple[int, float]]:
        """(rowid, cosine similarity) of the nearest vectors, best first. IVF-PQ ranks by
        codes of a few bits per sub-vector, which cannot tell near-ties apart: its best
        `pq_rerank` candidates are re-scored with their stored embeddings."""
        index = self.index
        rerank = self.settings.pq_rerank if self._params.kind == "ivfpq" else 0
        k = min(max(depth, rerank), max(1, index.num_vectors))
        scores, ids = index.search(vector, k, allowed)
        found = [(int(i), float(s)) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0]
        if rerank:
            exact = self._similarities(vector, [i for i, _ in found])
            found = sorted(exact.items(), key=lambda item: item[1], reverse=True)
        return found[:depth]

    def _lexical(self, query: str, depth: int, scope: _Scope) -> list[tuple[int, float]]:
        """(rowid, -BM25) of the chunks sharing the most telling words with the query."""
        match = match_expression(query)
        if match is None:
            return []
        return self.catalog.bm25(match, depth, scope.collections, scope.doc_ids)

    def _similarities(self, vector: np.ndarray, rowids: list[int]) -> dict[int, float]:
        """Cosine similarity of the query to chunks the index did not return, from their stored
        embeddings (unit vectors, as in the index)."""
        out: dict[int, float] = {}
        if not rowids:
            return out
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        for ids, vectors in self.catalog.embeddings(np.asarray(rowids), self._params.dim):
            out.update(zip(ids.tolist(), (vectors @ query).tolist(), strict=True))
        return out

    def get_document(
        self, collection: str, doc_id: str
    ) -> tuple[DocumentRecord, list[ChunkRecord]]:
        """A document and its chunks; raises UnknownDocumentError when there is none."""
        record = self.catalog.get_document(collection, doc_id)
        if record is None:
            raise UnknownDocumentError([doc_id], [collection])
        return record, self.catalog.document_chunks(collection, doc_id)

    def list_documents(
        self, collection: str, limit: int = 1000, offset: int = 0
    ) -> tuple[list[DocumentRecord], int]:
        """A page of the collection's documents, oldest first, and its number of documents."""
        return self.catalog.list_documents(collection, limit, offset), self.catalog.counts(
            collection
        )[0]

    def stats(self) -> Stats:
        documents, chunks = self.catalog.counts()
        return Stats(documents, chunks, self.index.num_vectors)

    def stop_work(self) -> None:
        """Make ingests still embedding raise EmbeddingStoppedError (at shutdown)."""
        self._stopping.set()

    def close(self) -> None:
        """Save the index so that the next start needs no rebuild."""
        started = time.perf_counter()
        if self.save_index():
            logger.info("index saved in %.2f s", time.perf_counter() - started)


def _hit_key(hit: SearchHit) -> tuple[str, str, str]:
    return (hit.collection, hit.doc_id, hit.chunk_id)
