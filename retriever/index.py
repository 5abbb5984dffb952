"""The FAISS vector index: inner product over unit vectors, flat (exact) or HNSW, with
int64 ids = catalog chunk rowids; saved atomically as a cache of the catalog."""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

logger = logging.getLogger(__name__)

IndexKind = Literal["flat", "hnsw"]
_MAGIC = b"RBIDX001"
# Below this many allowed ids a filtered HNSW search is done exactly instead (see search).
EXACT_FILTER_MAX_IDS = 20_000


@dataclass(frozen=True)
class IndexParams:
    kind: IndexKind
    dim: int
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 128


class _ReadWriteLock:
    """Many searches at once, or one writer: FAISS allows concurrent reads but not a read
    during `add`/`remove`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class VectorIndex:
    """An IndexIDMap2 over IndexFlatIP or IndexHNSWFlat.

    HNSW cannot remove vectors, so removed ids become tombstones that searches filter out;
    `tombstone_fraction` tells the owner when a rebuild pays off.
    """

    def __init__(self, params: IndexParams, faiss_index: faiss.Index | None = None):
        self.params = params
        self._index = faiss_index if faiss_index is not None else _new_index(params)
        self._tombstones: set[int] = set()
        self._lock = _ReadWriteLock()
        self._apply_search_params()

    def _apply_search_params(self) -> None:
        if self.params.kind == "hnsw":
            faiss.downcast_index(self._index.index).hnsw.efSearch = self.params.hnsw_ef_search

    @property
    def num_vectors(self) -> int:
        """Live vectors (tombstones excluded)."""
        return int(self._index.ntotal) - len(self._tombstones)

    @property
    def tombstone_fraction(self) -> float:
        return len(self._tombstones) / max(1, int(self._index.ntotal))

    def ids(self) -> np.ndarray:
        """Ids of the live vectors."""
        with self._lock.read():
            ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        if self._tombstones:
            ids = ids[~np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))]
        return ids

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids) == 0:
            return
        assert vectors.shape == (len(ids), self.params.dim), "vectors must be [n, dim]"
        with self._lock.write():
            self._index.add_with_ids(
                np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(ids, dtype=np.int64)
            )

    def remove(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        with self._lock.write():
            if self.params.kind == "flat":
                self._index.remove_ids(np.asarray(ids, dtype=np.int64))
            else:
                self._tombstones.update(int(i) for i in ids)

    def search(
        self, queries: np.ndarray, k: int, allowed_ids: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each [n_queries, k], best first; missing results have id -1.

        `allowed_ids` restricts the search to those ids (a doc_ids filter).
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.params.dim)
        if (
            self.params.kind == "hnsw"
            and allowed_ids is not None
            and len(allowed_ids) <= EXACT_FILTER_MAX_IDS
        ):
            return self._search_exact(queries, k, allowed_ids)
        # The selectors must outlive the search call: FAISS keeps raw pointers to them.
        selector = None
        if allowed_ids is not None:
            selector = faiss.IDSelectorBatch(np.asarray(allowed_ids, dtype=np.int64))
        with self._lock.read():
            tombstones = None
            if self._tombstones:
                tombstones = faiss.IDSelectorBatch(np.fromiter(self._tombstones, dtype=np.int64))
                if selector is None:
                    selector = faiss.IDSelectorNot(tombstones)
            params = None
            if selector is not None:
                if self.params.kind == "hnsw":
                    params = faiss.SearchParametersHNSW(
                        sel=selector, efSearch=max(self.params.hnsw_ef_search, k)
                    )
                else:
                    params = faiss.SearchParameters(sel=selector)
            elif self.params.kind == "hnsw" and k > self.params.hnsw_ef_search:
                params = faiss.SearchParametersHNSW(efSearch=k)
            scores, ids = self._index.search(queries, k, params=params)
        del tombstones
        return scores, ids

    def _search_exact(
        self, queries: np.ndarray, k: int, allowed_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Brute force over a few allowed ids: a filtered HNSW walk misses results when the
        filter keeps only a small part of the graph."""
        with self._lock.read():
            live = [int(i) for i in allowed_ids if int(i) not in self._tombstones]
            vectors = np.stack([self._index.reconstruct(i) for i in live]) if live else None
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        if vectors is None:
            return scores, ids
        sims = queries @ vectors.T  # [n_queries, n_allowed]
        order = np.argsort(-sims, axis=1)[:, :k]
        n = order.shape[1]
        scores[:, :n] = np.take_along_axis(sims, order, axis=1)
        ids[:, :n] = np.asarray(live, dtype=np.int64)[order]
        return scores, ids

    def to_bytes(self, generation: int) -> bytes:
        """The index and the catalog generation it reflects, in the file format."""
        with self._lock.read():
            body = faiss.serialize_index(self._index)
            header = json.dumps(
                {
                    "generation": generation,
                    "kind": self.params.kind,
                    "dim": self.params.dim,
                    "tombstones": sorted(self._tombstones),
                }
            ).encode()
        return _MAGIC + struct.pack("<Q", len(header)) + header + body.tobytes()

    def save(self, path: Path, generation: int) -> None:
        """Write atomically: a temporary file, fsync, rename, fsync of the folder."""
        write_atomic(path, self.to_bytes(generation))


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_index(path: Path, params: IndexParams) -> tuple[VectorIndex, int] | None:
    """(index, generation) from `path`; None when the file is missing, unreadable or was
    written with other parameters (a miss, logged: the caller rebuilds)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read index file %s: %s", path, exc)
        return None
    try:
        if data[:8] != _MAGIC:
            raise ValueError("bad magic")
        (header_len,) = struct.unpack("<Q", data[8:16])
        header = json.loads(data[16 : 16 + header_len])
        if header["kind"] != params.kind or header["dim"] != params.dim:
            logger.info(
                "index file %s is %s/%d, want %s/%d: rebuilding",
                path,
                header["kind"],
                header["dim"],
                params.kind,
                params.dim,
            )
            return None
        body = np.frombuffer(data, dtype=np.uint8, offset=16 + header_len)
        index = VectorIndex(params, faiss.deserialize_index(body.copy()))
        index._tombstones = {int(i) for i in header["tombstones"]}
        return index, int(header["generation"])
    except Exception as exc:  # a corrupt cache is a miss, never a crash
        logger.warning("index file %s is corrupt (%s): rebuilding", path, exc)
        return None


def _new_index(params: IndexParams) -> faiss.Index:
    if params.kind == "flat":
        base = faiss.IndexFlatIP(params.dim)
    else:
        base = faiss.IndexHNSWFlat(params.dim, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = params.hnsw_ef_construction
    return faiss.IndexIDMap2(base)
