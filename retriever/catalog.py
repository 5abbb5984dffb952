"""The chunk catalog in SQLite: documents, chunks, their text, token counts, metadata,
embeddings and a BM25 full-text index; the source of truth (FAISS is a cache rebuilt from it)."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.validation import DEFAULT_COLLECTION

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    collection TEXT NOT NULL,
    doc_id TEXT NOT NULL,
    content_sha256 TEXT NOT NULL,
    metadata TEXT NOT NULL,
    num_chars INTEGER NOT NULL,
    num_chunks INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (collection, doc_id)
);
-- AUTOINCREMENT: a rowid is never reused, so a stale FAISS entry can never point at a
-- different chunk: rowids are the FAISS vector ids. The same text in two collections is
-- two rows (two vectors) under one chunk_id: deleting one leaves the other.
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    collection TEXT NOT NULL,
    doc_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    chunk_id TEXT NOT NULL,
    text TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    start_char INTEGER NOT NULL,
    end_char INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    UNIQUE (collection, doc_id, position),
    FOREIGN KEY (collection, doc_id) REFERENCES documents (collection, doc_id)
);
CREATE INDEX IF NOT EXISTS chunks_by_chunk_id ON chunks (chunk_id);
"""
# One by one inside a transaction (`executescript` would commit the open one first); each
# statement ends a line with ';'.
_SCHEMA_STATEMENTS = tuple(s for s in _SCHEMA.split(";\n") if s.strip())
# Version 1 had no collections (documents keyed by doc_id alone). Its tables are rebuilt with
# every document in the default collection; chunk rowids are kept, so the FAISS index (and
# its file) stays valid, and the AUTOINCREMENT counter is carried over so no rowid is reused.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE documents RENAME TO documents_v1",
    "ALTER TABLE chunks RENAME TO chunks_v1",
    "DROP INDEX chunks_by_chunk_id",
    *_SCHEMA_STATEMENTS,
    "INSERT INTO documents SELECT :collection, doc_id, content_sha256, metadata, num_chars,"
    " num_chunks, num_tokens, created_at FROM documents_v1",
    "INSERT INTO chunks SELECT id, :collection, doc_id, position, chunk_id, text, num_tokens,"
    " start_char, end_char, embedding FROM chunks_v1",
    "DELETE FROM sqlite_sequence WHERE name = 'chunks'",
    "INSERT INTO sqlite_sequence (name, seq) SELECT 'chunks', seq FROM sqlite_sequence"
    " WHERE name = 'chunks_v1'",
    "DROP TABLE chunks_v1",
    "DROP TABLE documents_v1",
    "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
)
# BM25 over chunk text: an external-content FTS5 table (it stores only the inverted index; the
# text stays in `chunks`), kept in step by triggers, so every write that inserts or deletes
# chunks updates it in the same transaction. Porter stemming: "rivers" finds "river".
FTS_TABLE = "chunks_fts"
_FTS_STATEMENTS = (
    f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5(text, content='chunks', content_rowid='id',"
    " tokenize='porter unicode61 remove_diacritics 2')",
    f"CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN"
    f" INSERT INTO {FTS_TABLE} (rowid, text) VALUES (new.id, new.text); END",
    f"CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN"
    f" INSERT INTO {FTS_TABLE} ({FTS_TABLE}, rowid, text) VALUES ('delete', old.id, old.text);"
    " END",
    f"CREATE TRIGGER chunks_fts_update AFTER UPDATE OF text ON chunks BEGIN"
    f" INSERT INTO {FTS_TABLE} ({FTS_TABLE}, rowid, text) VALUES ('delete', old.id, old.text);"
    f" INSERT INTO {FTS_TABLE} (rowid, text) VALUES (new.id, new.text); END",
    # Backfill: a catalog written before the table existed gets every chunk indexed.
    f"INSERT INTO {FTS_TABLE} ({FTS_TABLE}) VALUES ('rebuild')",
)


class CatalogMismatchError(RuntimeError):
    """The catalog was built with another embedding model than the one configured."""


@dataclass(frozen=True)
class DocumentRecord:
    collection: str
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
    collection: str
    doc_id: str
    text: str
    num_tokens: int


@dataclass(frozen=True)
class WriteResult:
    """What a committed write changed, for the index to follow."""

    added_rowids: np.ndarray
    removed_rowids: np.ndarray
    generation: int


_DOCUMENT_COLUMNS = (
    "collection, doc_id, content_sha256, metadata, num_chars, num_chunks, num_tokens, created_at"
)


class Catalog:
    """SQLite catalog; every public method opens its own connection, so threads may share it.

    Documents are keyed by (collection, doc_id). Writers must be serialised by the caller (the
    service holds one lock); readers may run concurrently with a writer thanks to WAL mode.
    """

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
        with self._transaction() as conn:
            version = _schema_version(conn)
            if version == 1:
                for statement in _MIGRATE_1_TO_2:
                    conn.execute(statement, {"collection": DEFAULT_COLLECTION})
                logger.info(
                    "catalog %s migrated to schema 2: its documents are in collection %r",
                    path,
                    DEFAULT_COLLECTION,
                )
            elif version is None:
                for statement in _SCHEMA_STATEMENTS:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?), ('generation', '0')",
                    (str(SCHEMA_VERSION),),
                )
            elif version != SCHEMA_VERSION:
                raise CatalogMismatchError(
                    f"catalog {path} has schema {version}, newer than this retriever's "
                    f"{SCHEMA_VERSION}"
                )
            if not _has_table(conn, FTS_TABLE):
                for statement in _FTS_STATEMENTS:
                    conn.execute(statement)
                logger.info("catalog %s: full-text index built over its chunks", path)

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

    def get_document(self, collection: str, doc_id: str) -> DocumentRecord | None:
        with self._connect() as conn:
            row = conn.execute(
                f"SELECT {_DOCUMENT_COLUMNS} FROM documents WHERE collection = ? AND doc_id = ?",
                (collection, doc_id),
            ).fetchone()
        return _document(row) if row else None

    def list_documents(self, collection: str, limit: int, offset: int) -> list[DocumentRecord]:
        with self._connect() as conn:
            rows = conn.execute(
                f"SELECT {_DOCUMENT_COLUMNS} FROM documents WHERE collection = ?"
                " ORDER BY created_at, doc_id LIMIT ? OFFSET ?",
                (collection, limit, offset),
            ).fetchall()
        return [_document(row) for row in rows]

    def document_chunks(self, collection: str, doc_id: str) -> list[ChunkRecord]:
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT chunk_id, position, text, num_tokens, start_char, end_char FROM chunks"
                " WHERE collection = ? AND doc_id = ? ORDER BY position",
                (collection, doc_id),
            ).fetchall()
        return [ChunkRecord(*row) for row in rows]

    def collections(self) -> set[str]:
        """The collections holding at least one document."""
        with self._connect() as conn:
            rows = conn.execute("SELECT DISTINCT collection FROM documents").fetchall()
        return {r[0] for r in rows}

    def missing_documents(
        self, doc_ids: Sequence[str], collections: Sequence[str] | None = None
    ) -> list[str]:
        """The ids among `doc_ids` that no document of `collections` (None: any) has."""
        scope, params = _collection_clause(collections)
        with self._connect() as conn:
            return [
                d
                for d in doc_ids
                if conn.execute(
                    f"SELECT 1 FROM documents WHERE doc_id = ?{scope} LIMIT 1", (d, *params)
                ).fetchone()
                is None
            ]

    def counts(self, collection: str | None = None) -> tuple[int, int]:
        """(number of documents, number of chunks), of one collection or of all."""
        scope, params = _collection_clause(None if collection is None else [collection])
        where = " WHERE 1 = 1" + scope
        with self._connect() as conn:
            docs = conn.execute(f"SELECT COUNT(*) FROM documents{where}", params).fetchone()[0]
            chunks = conn.execute(f"SELECT COUNT(*) FROM chunks{where}", params).fetchone()[0]
        return int(docs), int(chunks)

    def rowids(
        self, collections: Sequence[str] | None = None, doc_ids: Sequence[str] | None = None
    ) -> np.ndarray:
        """Vector ids (chunk rowids) of the chunks in `collections` and of `doc_ids` (None:
        no restriction on that side)."""
        scope, params = _collection_clause(collections)
        if doc_ids is not None:
            scope += f" AND doc_id IN ({','.join('?' * len(doc_ids))})"
            params = [*params, *doc_ids]
        with self._connect() as conn:
            rows = conn.execute(f"SELECT id FROM chunks WHERE 1 = 1{scope}", params).fetchall()
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
                "SELECT id, chunk_id, collection, doc_id, text, num_tokens FROM chunks"
                f" WHERE id IN ({marks})",
                [int(r) for r in rowids],
            ).fetchall()
        return {row[0]: ChunkHit(*row[1:]) for row in rows}

    def bm25(
        self,
        match: str,
        limit: int,
        collections: Sequence[str] | None = None,
        doc_ids: Sequence[str] | None = None,
    ) -> list[tuple[int, float]]:
        """(rowid, score) of the `limit` best chunks for an FTS5 `match` expression (built by
        retriever.bm25.match_expression, never raw user text), best first. score = -bm25: FTS5's
        BM25 is lower for better matches, negated so that higher is better, as for cosine."""
        scope, params = _collection_clause(collections, "c.")
        if doc_ids is not None:
            scope += f" AND c.doc_id IN ({','.join('?' * len(doc_ids))})"
            params = [*params, *doc_ids]
        with self._connect() as conn:
            rows = conn.execute(
                f"SELECT c.id, bm25({FTS_TABLE}) AS s FROM {FTS_TABLE}"
                f" JOIN chunks c ON c.id = {FTS_TABLE}.rowid"
                f" WHERE {FTS_TABLE} MATCH ?{scope} ORDER BY s LIMIT ?",
                [match, *params, limit],
            ).fetchall()
        return [(int(rowid), -float(score)) for rowid, score in rows]

    def put_document(
        self,
        collection: str,
        doc_id: str,
        content_sha256: str,
        metadata: dict[str, Any],
        num_chars: int,
        chunks: Sequence[ChunkRecord],
        vectors: np.ndarray,
    ) -> WriteResult:
        """Store a document with all its chunks in one transaction, replacing a document of
        the same collection and id; either all of it is committed or nothing."""
        assert len(chunks) == len(vectors), "one vector per chunk"
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._transaction() as conn:
            removed = _delete(conn, collection, doc_id)
            conn.execute(
                "INSERT INTO documents VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    collection,
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
                    "INSERT INTO chunks (collection, doc_id, position, chunk_id, text,"
                    " num_tokens, start_char, end_char, embedding)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        collection,
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

    def update_metadata(self, collection: str, doc_id: str, metadata: dict[str, Any]) -> None:
        with self._transaction() as conn:
            conn.execute(
                "UPDATE documents SET metadata = ? WHERE collection = ? AND doc_id = ?",
                (json.dumps(metadata), collection, doc_id),
            )

    def delete_document(self, collection: str, doc_id: str) -> WriteResult | None:
        """Remove a document and its chunks in one transaction; None when it is unknown."""
        with self._transaction() as conn:
            found = conn.execute(
                "SELECT 1 FROM documents WHERE collection = ? AND doc_id = ?",
                (collection, doc_id),
            ).fetchone()
            if found is None:
                return None
            removed = _delete(conn, collection, doc_id)
            generation = self._bump_generation(conn)
        return WriteResult(np.zeros(0, dtype=np.int64), removed, generation)


def _schema_version(conn: sqlite3.Connection) -> int | None:
    """The stored schema version; None for a new, empty catalog."""
    if not _has_table(conn, "meta"):
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone()
    return found is not None


def _collection_clause(collections: Sequence[str] | None, table: str = "") -> tuple[str, list[str]]:
    """An `AND collection IN (...)` clause and its parameters; nothing for None (all)."""
    if collections is None:
        return "", []
    marks = ",".join("?" * len(collections))
    return f" AND {table}collection IN ({marks})", list(collections)


def _delete(conn: sqlite3.Connection, collection: str, doc_id: str) -> np.ndarray:
    key = (collection, doc_id)
    rows = conn.execute("SELECT id FROM chunks WHERE collection = ? AND doc_id = ?", key).fetchall()
    conn.execute("DELETE FROM chunks WHERE collection = ? AND doc_id = ?", key)
    conn.execute("DELETE FROM documents WHERE collection = ? AND doc_id = ?", key)
    return np.asarray([r[0] for r in rows], dtype=np.int64)


def _document(row: tuple) -> DocumentRecord:
    return DocumentRecord(
        row[0], row[1], row[2], json.loads(row[3]), row[4], row[5], row[6], row[7]
    )


def _unpack(rows: list[tuple[int, bytes]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray([r[0] for r in rows], dtype=np.int64)
    vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
    return ids, vectors
