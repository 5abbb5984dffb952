"""The FAISS vector index: inner product over unit vectors, flat (exact), HNSW, IVF or IVF-PQ,
with int64 ids = catalog chunk rowids; saved atomically as a cache of the catalog."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import faiss
import numpy as np

if TYPE_CHECKING:
    from retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

IndexKind = Literal["flat", "hnsw", "ivf", "ivfpq"]
_MAGIC = b"RBIDX001"
# Below this many allowed ids a filtered HNSW search is done exactly instead (see search).
EXACT_FILTER_MAX_IDS = 20_000
# auto_ef_search: the beam at up to this many vectors, four times wider per tenfold beyond.
AUTO_EF_BASE = 1024
AUTO_EF_BASE_VECTORS = 100_000
AUTO_EF_GROWTH = 4
# k-means wants about this many training points per centroid (FAISS warns below 39).
_POINTS_PER_CENTROID_MIN = 39
# ... and gains little from more than this many; a larger sample only slows training.
_POINTS_PER_CENTROID_MAX = 64


@dataclass(frozen=True)
class IndexParams:
    kind: IndexKind
    dim: int
    hnsw_m: int = 48
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int | None = None  # None: auto_ef_search(live vectors)
    ivf_nlist: int = 1024
    ivf_nprobe: int = 128
    ivf_train_min: int = 0
    pq_m: int = 48
    pq_bits: int = 8

    @classmethod
    def from_settings(cls, settings: RetrieverSettings, dim: int) -> IndexParams:
        return cls(
            kind=settings.index,
            dim=dim,
            hnsw_m=settings.hnsw_m,
            hnsw_ef_construction=settings.hnsw_ef_construction,
            hnsw_ef_search=settings.hnsw_ef_search,
            ivf_nlist=settings.ivf_nlist,
            ivf_nprobe=settings.ivf_nprobe,
            ivf_train_min=settings.ivf_train_min,
            pq_m=settings.pq_m,
            pq_bits=settings.pq_bits,
        )

    def __post_init__(self) -> None:
        if self.kind == "ivfpq" and self.dim % self.pq_m:
            raise ValueError(f"pq_m ({self.pq_m}) must divide the embedding dimension {self.dim}")

    @property
    def ivf(self) -> bool:
        return self.kind in ("ivf", "ivfpq")

    @property
    def train_at(self) -> int:
        """Live vectors an IVF index waits for, exact and flat, before it trains: enough
        for k-means over `ivf_nlist` centroids (and over the 2^pq_bits codes of each PQ
        sub-quantizer), and at least `ivf_train_min`."""
        need = _POINTS_PER_CENTROID_MIN * self.ivf_nlist
        if self.kind == "ivfpq":
            need = max(need, _POINTS_PER_CENTROID_MIN * 2**self.pq_bits)
        return max(self.ivf_train_min, need)

    def build_key(self) -> dict[str, int]:
        """The build parameters an index file must share with the settings to be reused
        (search-time ones such as efSearch or nprobe are applied on load instead)."""
        if self.kind == "hnsw":
            return {"m": self.hnsw_m}
        if self.kind == "ivf":
            return {"nlist": self.ivf_nlist}
        if self.kind == "ivfpq":
            return {"nlist": self.ivf_nlist, "pq_m": self.pq_m, "pq_bits": self.pq_bits}
        return {}


def auto_ef_search(vectors: int) -> int:
    """The HNSW search beam for an index of `vectors`: 1024 up to 100,000, four times wider
    per tenfold beyond (4096 at 1M), the beam that keeps recall@5 >= 0.95 with the default
    graph (M 48, efConstruction 200) on the synthetic benchmark of docs/benchmarks/retriever.md
    (near-equidistant vectors; real embeddings need far less)."""
    if vectors <= AUTO_EF_BASE_VECTORS:
        return AUTO_EF_BASE
    return round(AUTO_EF_BASE * (vectors / AUTO_EF_BASE_VECTORS) ** math.log10(AUTO_EF_GROWTH))


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
    """An IndexIDMap2 over IndexFlatIP or IndexHNSWFlat, or an IndexIVFFlat / IndexIVFPQ.

    HNSW cannot remove vectors, so removed ids become tombstones that searches filter out;
    `tombstone_fraction` tells the owner when a rebuild pays off. An IVF kind holds its
    vectors flat (and searches exactly) until `params.train_at` live vectors exist, then
    trains its centroids on them once and moves them into the inverted lists.
    """

    def __init__(self, params: IndexParams, faiss_index: faiss.Index | None = None):
        self.params = params
        self._index = faiss_index if faiss_index is not None else _new_index(params)
        self._tombstones: set[int] = set()
        self._lock = _ReadWriteLock()
        # Serialises add/remove/training, so that training can run outside the write lock
        # (searches go on against the flat vectors meanwhile) without missing a write.
        self._mutate = threading.Lock()

    @property
    def trained(self) -> bool:
        """True for an IVF kind once its vectors are in inverted lists."""
        return isinstance(self._index, faiss.IndexIVF)

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
            if self.trained:
                ids = _list_ids(self._index)
            else:
                ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        if self._tombstones:
            ids = ids[~np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))]
        return ids

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids) == 0:
            return
        assert vectors.shape == (len(ids), self.params.dim), "vectors must be [n, dim]"
        with self._mutate:
            with self._lock.write():
                self._index.add_with_ids(
                    np.ascontiguousarray(vectors, dtype=np.float32),
                    np.asarray(ids, dtype=np.int64),
                )
            self._train_if_due()

    def remove(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        with self._mutate, self._lock.write():
            if self.params.kind == "hnsw":
                self._tombstones.update(int(i) for i in ids)
            else:
                self._index.remove_ids(np.asarray(ids, dtype=np.int64))

    def train_if_due(self) -> None:
        """Train an IVF kind that holds enough vectors (done by `add`; also on load, in
        case the file was written under a higher threshold)."""
        with self._mutate:
            self._train_if_due()

    def _train_if_due(self) -> None:
        if not self.params.ivf or self.trained or self.num_vectors < self.params.train_at:
            return
        started = time.perf_counter()
        with self._lock.read():
            ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
            vectors = self._index.index.reconstruct_n(0, len(ids))
        trained = _train_ivf(self.params, ids, vectors)
        with self._lock.write():
            self._index = trained
        logger.info(
            "trained the %s index (%d lists) on %d vectors in %.1f s",
            self.params.kind,
            self.params.ivf_nlist,
            len(ids),
            time.perf_counter() - started,
        )

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
            allowed = None if allowed_ids is None else len(allowed_ids)
            params = self._search_params(k, selector, allowed)
            scores, ids = self._index.search(queries, k, params=params)
        del tombstones
        return scores, ids

    def _search_params(
        self, k: int, selector: faiss.IDSelector | None, allowed: int | None
    ) -> faiss.SearchParameters | None:
        """The search-time settings, passed with every search (so `params` can change)."""
        extra: dict[str, Any] = {} if selector is None else {"sel": selector}
        if self.trained:
            # A filter keeping a fraction f of the vectors probes 1/f times more lists, so a
            # search still scores about as many allowed vectors as an unfiltered one; a
            # small filter thus probes every list and is exact (IVF-Flat).
            nprobe = self.params.ivf_nprobe
            if allowed is not None:
                nprobe = math.ceil(nprobe * self._index.ntotal / max(1, allowed))
            return faiss.SearchParametersIVF(nprobe=min(self._index.nlist, nprobe), **extra)
        if self.params.kind == "hnsw":
            efs = max(self.params.hnsw_ef_search or auto_ef_search(self.num_vectors), k)
            return faiss.SearchParametersHNSW(efSearch=efs, **extra)
        return faiss.SearchParameters(**extra) if extra else None

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
                    "build": self.params.build_key(),
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
        found = (header["kind"], header["dim"], header.get("build", {}))
        wanted = (params.kind, params.dim, params.build_key())
        if found != wanted:
            logger.info("index file %s is %s, want %s: rebuilding", path, found, wanted)
            return None
        body = np.frombuffer(data, dtype=np.uint8, offset=16 + header_len)
        index = VectorIndex(params, faiss.deserialize_index(body.copy()))
        index._tombstones = {int(i) for i in header["tombstones"]}
    except Exception as exc:  # a corrupt cache is a miss, never a crash
        logger.warning("index file %s is corrupt (%s): rebuilding", path, exc)
        return None
    index.train_if_due()
    return index, int(header["generation"])


def _new_index(params: IndexParams) -> faiss.Index:
    if params.kind == "hnsw":
        base = faiss.IndexHNSWFlat(params.dim, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = params.hnsw_ef_construction
    else:  # flat, and an IVF kind until it has enough vectors to train on
        base = faiss.IndexFlatIP(params.dim)
    return faiss.IndexIDMap2(base)


def _train_ivf(params: IndexParams, ids: np.ndarray, vectors: np.ndarray) -> faiss.IndexIVF:
    """An IVF index trained on (a sample of) `vectors` and holding all of them.

    The IVF keeps the ids itself (no IndexIDMap2: its removal assumes a flat index's
    compaction); removal scans the lists for the ids, which needs no id→list map in memory.
    """
    quantizer = faiss.IndexFlatIP(params.dim)
    if params.kind == "ivf":
        ivf = faiss.IndexIVFFlat(
            quantizer, params.dim, params.ivf_nlist, faiss.METRIC_INNER_PRODUCT
        )
    else:
        ivf = faiss.IndexIVFPQ(
            quantizer,
            params.dim,
            params.ivf_nlist,
            params.pq_m,
            params.pq_bits,
            faiss.METRIC_INNER_PRODUCT,
        )
    sample_size = min(len(vectors), _POINTS_PER_CENTROID_MAX * params.ivf_nlist)
    if params.kind == "ivfpq":
        sample_size = max(
            sample_size, min(len(vectors), _POINTS_PER_CENTROID_MAX * 2**params.pq_bits)
        )
    sample = np.random.default_rng(0).choice(len(vectors), size=sample_size, replace=False)
    ivf.train(vectors[np.sort(sample)])
    ivf.add_with_ids(vectors, ids)
    return ivf


def _list_ids(ivf: faiss.IndexIVF) -> np.ndarray:
    """Every id stored in the inverted lists."""
    invlists = ivf.invlists
    parts = []
    for lst in range(ivf.nlist):
        size = invlists.list_size(lst)
        if size:
            parts.append(faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy())
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)
