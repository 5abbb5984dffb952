"""The chunk catalog in SQLite: documents, chunks, their text, token counts, metadata and
embeddings. It is the source of truth; the FAISS index is a cache rebuilt from it."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    doc_id TEXT PRIMARY KEY,
    content_sha256 TEXT NOT NULL,
    metadata TEXT NOT NULL,
    num_chars INTEGER NOT NULL,
    num_chunks INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    created_at REAL NOT NULL
);
-- AUTOINCREMENT: a rowid is never reused, so a stale FAISS entry can never point at a
-- different chunk; rowids are the FAISS vector ids.
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    doc_id TEXT NOT NULL REFERENCES documents(doc_id),
    position INTEGER NOT NULL,
    chunk_id TEXT NOT NULL,
    text TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    start_char INTEGER NOT NULL,
    end_char INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    UNIQUE (doc_id, position)
);
CREATE INDEX IF NOT EXISTS chunks_by_chunk_id ON chunks (chunk_id);
"""


class CatalogMismatchError(RuntimeError):
    """The catalog was built with another embedding model than the one configured."""


@dataclass(frozen=True)
class DocumentRecord:
    doc_id: str
    content_sha256: str
    metadata: dict[str, Any]
    num_chars: int
    num_chunks: int
    num_tokens: int
    created_at: float


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk as stored; `position` is its order inside the document."""

    chunk_id: str
    position: int
    text: str
    num_tokens: int
    start_char: int
    end_char: int


@dataclass(frozen=True)
class ChunkHit:
    chunk_id: str
    doc_id: str
    text: str


@dataclass(frozen=True)
class WriteResult:
    """What a committed write changed, for the index to follow."""

    added_rowids: np.ndarray
    removed_rowids: np.ndarray
    generation: int


class Catalog:
    """SQLite catalog; every public method opens its own connection, so threads may share it.

    Writers must be serialised by the caller (the service holds one lock); readers may run
    concurrently with a writer thanks to WAL mode.
    """

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            conn.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?), ('generation', '0')",
                (str(SCHEMA_VERSION),),
            )

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        try:
            # FULL: a commit survives power loss too, not only a killed process.
            conn.execute("PRAGMA synchronous=FULL")
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @staticmethod
    def _bump_generation(conn: sqlite3.Connection) -> int:
        conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key='generation'")
        return int(conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()[0])

    def generation(self) -> int:
        """A number that grows with every committed write."""
        with self._connect() as conn:
            return int(conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()[0])

    def bind_embedding_model(self, model: str, dim: int) -> None:
        """Record the embedding model on first use; raise CatalogMismatchError on a change."""
        with self._transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key='embedding_model'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta VALUES ('embedding_model', ?)",
                    (json.dumps({"model": model, "dim": dim}),),
                )
                return
            stored = json.loads(row[0])
            if stored != {"model": model, "dim": dim}:
                raise CatalogMismatchError(
                    f"catalog {self.path} holds embeddings of {stored['model']} "
                    f"(dim {stored['dim']}), not {model} (dim {dim}); use another data_dir"
                )

    def get_document(self, doc_id: str) -> DocumentRecord | None:
        with self._connect() as conn:
            row = conn.execute(
                "SELECT doc_id, content_sha256, metadata, num_chars, num_chunks, num_tokens,"
                " created_at FROM documents WHERE doc_id = ?",
                (doc_id,),
            ).fetchone()
        return _document(row) if row else None

    def list_documents(self, limit: int, offset: int) -> list[DocumentRecord]:
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT doc_id, content_sha256, metadata, num_chars, num_chunks, num_tokens,"
                " created_at FROM documents ORDER BY created_at, doc_id LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [_document(row) for row in rows]

    def document_chunks(self, doc_id: str) -> list[ChunkRecord]:
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT chunk_id, position, text, num_tokens, start_char, end_char FROM chunks"
                " WHERE doc_id = ? ORDER BY position",
                (doc_id,),
            ).fetchall()
        return [ChunkRecord(*row) for row in rows]

    def missing_documents(self, doc_ids: Sequence[str]) -> list[str]:
        with self._connect() as conn:
            return [
                d
                for d in doc_ids
                if conn.execute("SELECT 1 FROM documents WHERE doc_id = ?", (d,)).fetchone() is None
            ]

    def counts(self) -> tuple[int, int]:
        """(number of documents, number of chunks)."""
        with self._connect() as conn:
            docs = conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        return int(docs), int(chunks)

    def rowids(self, doc_ids: Sequence[str] | None = None) -> np.ndarray:
        """Vector ids (chunk rowids) of the given documents, or of all chunks."""
        with self._connect() as conn:
            if doc_ids is None:
                rows = conn.execute("SELECT id FROM chunks").fetchall()
            else:
                marks = ",".join("?" * len(doc_ids))
                rows = conn.execute(
                    f"SELECT id FROM chunks WHERE doc_id IN ({marks})", list(doc_ids)
                ).fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def embeddings(
        self, rowids: np.ndarray | None, dim: int, batch: int = 4096
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rowids, vectors [n, dim]) in batches, for all chunks or the given rowids."""
        with self._connect() as conn:
            if rowids is None:
                cursor = conn.execute("SELECT id, embedding FROM chunks ORDER BY id")
                while rows := cursor.fetchmany(batch):
                    yield _unpack(rows, dim)
                return
            ids = [int(i) for i in rowids]
            for start in range(0, len(ids), 500):
                part = ids[start : start + 500]
                marks = ",".join("?" * len(part))
                rows = conn.execute(
                    f"SELECT id, embedding FROM chunks WHERE id IN ({marks})", part
                ).fetchall()
                if rows:
                    yield _unpack(rows, dim)

    def chunks_by_rowid(self, rowids: Sequence[int]) -> dict[int, ChunkHit]:
        """The chunks that still exist among `rowids`; a deleted one is simply absent."""
        if not rowids:
            return {}
        marks = ",".join("?" * len(rowids))
        with self._connect() as conn:
            rows = conn.execute(
                f"SELECT id, chunk_id, doc_id, text FROM chunks WHERE id IN ({marks})",
                [int(r) for r in rowids],
            ).fetchall()
        return {row[0]: ChunkHit(row[1], row[2], row[3]) for row in rows}

    def put_document(
        self,
        doc_id: str,
        content_sha256: str,
        metadata: dict[str, Any],
        num_chars: int,
        chunks: Sequence[ChunkRecord],
        vectors: np.ndarray,
    ) -> WriteResult:
        """Store a document with all its chunks in one transaction, replacing a document of
        the same id; either all of it is committed or nothing."""
        assert len(chunks) == len(vectors), "one vector per chunk"
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._transaction() as conn:
            removed = _delete(conn, doc_id)
            conn.execute(
                "INSERT INTO documents VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    doc_id,
                    content_sha256,
                    json.dumps(metadata),
                    num_chars,
                    len(chunks),
                    sum(c.num_tokens for c in chunks),
                    time.time(),
                ),
            )
            added = []
            for chunk, vector in zip(chunks, vectors, strict=True):
                cursor = conn.execute(
                    "INSERT INTO chunks (doc_id, position, chunk_id, text, num_tokens,"
                    " start_char, end_char, embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        doc_id,
                        chunk.position,
                        chunk.chunk_id,
                        chunk.text,
                        chunk.num_tokens,
                        chunk.start_char,
                        chunk.end_char,
                        vector.tobytes(),
                    ),
                )
                added.append(cursor.lastrowid)
            generation = self._bump_generation(conn)
        return WriteResult(np.asarray(added, dtype=np.int64), removed, generation)

    def update_metadata(self, doc_id: str, metadata: dict[str, Any]) -> None:
        with self._transaction() as conn:
            conn.execute(
                "UPDATE documents SET metadata = ? WHERE doc_id = ?", (json.dumps(metadata), doc_id)
            )

    def delete_document(self, doc_id: str) -> WriteResult | None:
        """Remove a document and its chunks in one transaction; None when it is unknown."""
        with self._transaction() as conn:
            found = conn.execute("SELECT 1 FROM documents WHERE doc_id = ?", (doc_id,)).fetchone()
            if found is None:
                return None
            removed = _delete(conn, doc_id)
            generation = self._bump_generation(conn)
        return WriteResult(np.zeros(0, dtype=np.int64), removed, generation)


def _delete(conn: sqlite3.Connection, doc_id: str) -> np.ndarray:
    rows = conn.execute("SELECT id FROM chunks WHERE doc_id = ?", (doc_id,)).fetchall()
    conn.execute("DELETE FROM chunks WHERE doc_id = ?", (doc_id,))
    conn.execute("DELETE FROM documents WHERE doc_id = ?", (doc_id,))
    return np.asarray([r[0] for r in rows], dtype=np.int64)


def _document(row: tuple) -> DocumentRecord:
    return DocumentRecord(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6])


def _unpack(rows: list[tuple[int, bytes]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray([r[0] for r in rows], dtype=np.int64)
    vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
    return ids, vectors
