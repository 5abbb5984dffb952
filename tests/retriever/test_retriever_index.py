"""The FAISS index on its own: flat, HNSW, IVF and IVF-PQ search, removal (HNSW tombstones),
id filters, IVF training, recall on clustered data, and the atomic file that is a miss when
missing, corrupt or built with other parameters."""

from __future__ import annotations

from collections.abc import Iterator

import faiss
import numpy as np
import pytest

from retriever.index import IndexParams, VectorIndex, auto_ef_search, load_index

DIM = 32
N = 800
# Small IVF settings so that 800 vectors train: 8 lists (train_at = 39 * 8 = 312) and, for
# PQ, 16 sub-quantizers of 2 dimensions with 4-bit codes (train_at = 39 * 16 = 624).
SMALL = dict(ivf_nlist=8, ivf_nprobe=2, pq_m=16, pq_bits=4)
KINDS = ["flat", "hnsw", "ivf", "ivfpq"]


@pytest.fixture(autouse=True)
def _one_faiss_thread() -> Iterator[None]:
    """k-means and HNSW builds on OpenMP threads slow down 10-20 times when other processes
    hold the cores (the threads wait on each other); one thread keeps these tests steady."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def _unit(n: int, seed: int, dim: int = DIM) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _params(kind: str, **overrides: int) -> IndexParams:
    return IndexParams(kind=kind, dim=DIM, **{**SMALL, **overrides})  # type: ignore[arg-type]


def _exact(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-(queries @ vectors.T), axis=1)[:, :k]
    return ids[order]


@pytest.fixture(params=KINDS)
def index(request) -> VectorIndex:
    built = VectorIndex(_params(request.param))
    built.add(np.arange(1000, 1000 + N, dtype=np.int64), _unit(N, seed=1))
    assert built.trained == built.params.ivf
    return built


def test_a_stored_vector_is_its_own_best_match_with_score_one(index):
    vectors = _unit(N, seed=1)
    scores, ids = index.search(vectors[[7, 150]], k=3)
    assert ids[:, 0].tolist() == [1007, 1150]
    # PQ scores come from 4-bit codes of 2-dimension pieces: near 1, not exact.
    tolerance = 0.2 if index.params.kind == "ivfpq" else 1e-5
    assert np.allclose(scores[:, 0], 1.0, atol=tolerance)
    assert (scores[:, 0] >= scores[:, 1]).all()


def test_removed_ids_are_never_returned(index):
    vectors = _unit(N, seed=1)
    index.remove(np.array([1007, 1008], dtype=np.int64))
    _, ids = index.search(vectors[[7, 8]], k=20)
    assert 1007 not in ids and 1008 not in ids
    assert index.num_vectors == N - 2
    assert set(index.ids().tolist()) == set(range(1000, 1000 + N)) - {1007, 1008}


def test_allowed_ids_restrict_the_search(index):
    vectors = _unit(N, seed=1)
    allowed = np.array([1100, 1200, 1250], dtype=np.int64)
    _, ids = index.search(vectors[[7]], k=5, allowed_ids=allowed)
    assert set(ids[0][ids[0] >= 0].tolist()) == {1100, 1200, 1250}


def test_a_small_filter_on_ivf_flat_is_answered_exactly_in_order():
    # nprobe=1 of 8 lists would see about an eighth of 40 allowed ids; the filter raises
    # nprobe by the fraction it keeps, so every list is scanned.
    vectors, ids = _unit(N, seed=1), np.arange(1000, 1000 + N, dtype=np.int64)
    index = VectorIndex(_params("ivf", ivf_nprobe=1))
    index.add(ids, vectors)
    allowed = ids[::20]
    queries = _unit(5, seed=9)
    _, found = index.search(queries, k=10, allowed_ids=allowed)
    assert np.array_equal(found, _exact(vectors[::20], allowed, queries, 10))


def test_saved_index_loads_with_its_generation_and_answers_the_same(index, tmp_path):
    vectors = _unit(N, seed=1)
    index.remove(np.array([1003], dtype=np.int64))
    path = tmp_path / "index.faiss"
    index.save(path, generation=42)
    loaded = load_index(path, index.params)
    assert loaded is not None
    again, generation = loaded
    assert generation == 42
    assert again.trained == index.trained
    assert not (tmp_path / "index.faiss.tmp").exists()
    for query in (vectors[[3]], vectors[[99]]):
        assert np.array_equal(index.search(query, 10)[1], again.search(query, 10)[1])
    assert 1003 not in again.ids()


def test_missing_corrupt_or_mismatched_index_file_is_a_miss(index, tmp_path):
    path = tmp_path / "index.faiss"
    assert load_index(path, index.params) is None
    index.save(path, generation=1)
    other_kind = "hnsw" if index.params.kind == "flat" else "flat"
    assert load_index(path, _params(other_kind)) is None
    path.write_bytes(path.read_bytes()[:100])
    assert load_index(path, index.params) is None


@pytest.mark.parametrize(
    ("kind", "other"),
    [("hnsw", dict(hnsw_m=16)), ("ivf", dict(ivf_nlist=4)), ("ivfpq", dict(pq_m=8))],
)
def test_an_index_file_built_with_other_build_parameters_is_a_miss(kind, other, tmp_path):
    path = tmp_path / "index.faiss"
    index = VectorIndex(_params(kind))
    index.add(np.arange(N, dtype=np.int64), _unit(N, seed=1))
    index.save(path, generation=1)
    assert load_index(path, _params(kind, ivf_nprobe=7, hnsw_ef_search=99)) is not None
    assert load_index(path, _params(kind, **other)) is None


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_an_ivf_index_is_flat_and_exact_until_it_holds_enough_vectors_to_train(kind, tmp_path):
    vectors, ids = _unit(N, seed=1), np.arange(1000, 1000 + N, dtype=np.int64)
    params = _params(kind, ivf_train_min=700)
    index = VectorIndex(params)
    index.add(ids[:600], vectors[:600])
    index.remove(ids[:5])
    assert not index.trained
    queries = _unit(20, seed=3)
    _, found = index.search(queries, k=5)
    assert np.array_equal(found, _exact(vectors[5:600], ids[5:600], queries, 5))
    # An untrained index persists as such, with its removals.
    index.save(tmp_path / "index.faiss", generation=1)
    loaded = load_index(tmp_path / "index.faiss", params)
    assert loaded is not None and not loaded[0].trained
    index = loaded[0]
    index.add(ids[600:], vectors[600:])
    assert index.trained
    assert index.num_vectors == N - 5
    assert set(index.ids().tolist()) == set(ids[5:].tolist())
    _, found = index.search(vectors[[700]], k=1)
    assert found[0, 0] == ids[700]


def test_a_loaded_untrained_ivf_file_trains_when_the_threshold_was_lowered(tmp_path):
    index = VectorIndex(_params("ivf", ivf_train_min=N + 1))
    index.add(np.arange(N, dtype=np.int64), _unit(N, seed=1))
    assert not index.trained
    index.save(tmp_path / "index.faiss", generation=1)
    loaded = load_index(tmp_path / "index.faiss", _params("ivf"))
    assert loaded is not None and loaded[0].trained


def test_pq_sub_quantizers_must_divide_the_dimension():
    with pytest.raises(ValueError, match="pq_m"):
        IndexParams(kind="ivfpq", dim=DIM, pq_m=5)


def _clustered(n_clusters: int, per_cluster: int, dim: int, seed: int) -> np.ndarray:
    """Unit vectors around random centres, like embeddings of a few topics."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, dim))
    points = np.repeat(centres, per_cluster, axis=0) + 0.5 * rng.standard_normal(
        (n_clusters * per_cluster, dim)
    )
    points = points.astype(np.float32)
    return points / np.linalg.norm(points, axis=1, keepdims=True)


@pytest.mark.parametrize(
    ("kind", "overrides", "floor"),
    [
        ("hnsw", dict(hnsw_ef_search=64), 0.95),
        ("ivf", dict(ivf_nlist=32, ivf_nprobe=8), 0.9),
        ("ivfpq", dict(ivf_nlist=32, ivf_nprobe=8, pq_m=32, pq_bits=6), 0.6),
    ],
)
def test_recall_at_5_against_exact_search_on_clustered_vectors(kind, overrides, floor):
    dim = 64
    data = _clustered(50, 80, dim, seed=5)
    queries, vectors = data[:100], data[100:]
    ids = np.arange(len(vectors), dtype=np.int64)
    index = VectorIndex(IndexParams(kind=kind, dim=dim, **overrides))  # type: ignore[arg-type]
    index.add(ids, vectors)
    assert index.trained == (kind != "hnsw")
    _, found = index.search(queries, k=5)
    exact = _exact(vectors, ids, queries, 5)
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(found, exact, strict=True)])
    assert recall >= floor, f"{kind} recall@5 {recall:.3f}"


def test_the_default_hnsw_search_beam_grows_fourfold_per_tenfold_beyond_100k_vectors():
    assert [auto_ef_search(n) for n in (10, 100_000, 1_000_000, 10_000_000)] == [
        1024,
        1024,
        4096,
        16384,
    ]
