"""The FAISS index on its own: flat and HNSW search, removal (HNSW tombstones), id filters,
and the atomic file that is a miss when missing, corrupt or of another kind."""

from __future__ import annotations

import numpy as np
import pytest

from retriever.index import IndexParams, VectorIndex, load_index

DIM = 32


def _unit(n: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.fixture(params=["flat", "hnsw"])
def index(request) -> VectorIndex:
    built = VectorIndex(IndexParams(kind=request.param, dim=DIM))
    built.add(np.arange(1000, 1300, dtype=np.int64), _unit(300, seed=1))
    return built


def test_a_stored_vector_is_its_own_best_match_with_score_one(index):
    vectors = _unit(300, seed=1)
    scores, ids = index.search(vectors[[7, 150]], k=3)
    assert ids[:, 0].tolist() == [1007, 1150]
    assert np.allclose(scores[:, 0], 1.0, atol=1e-5)
    assert (scores[:, 0] >= scores[:, 1]).all()


def test_removed_ids_are_never_returned(index):
    vectors = _unit(300, seed=1)
    index.remove(np.array([1007, 1008], dtype=np.int64))
    _, ids = index.search(vectors[[7, 8]], k=20)
    assert 1007 not in ids and 1008 not in ids
    assert index.num_vectors == 298
    assert set(index.ids().tolist()) == set(range(1000, 1300)) - {1007, 1008}


def test_allowed_ids_restrict_the_search(index):
    vectors = _unit(300, seed=1)
    allowed = np.array([1100, 1200, 1250], dtype=np.int64)
    _, ids = index.search(vectors[[7]], k=5, allowed_ids=allowed)
    assert set(ids[0][ids[0] >= 0].tolist()) == {1100, 1200, 1250}


def test_saved_index_loads_with_its_generation_and_answers_the_same(index, tmp_path):
    vectors = _unit(300, seed=1)
    index.remove(np.array([1003], dtype=np.int64))
    path = tmp_path / "index.faiss"
    index.save(path, generation=42)
    loaded = load_index(path, index.params)
    assert loaded is not None
    again, generation = loaded
    assert generation == 42
    assert not (tmp_path / "index.faiss.tmp").exists()
    for query in (vectors[[3]], vectors[[99]]):
        assert np.array_equal(index.search(query, 10)[1], again.search(query, 10)[1])


def test_missing_corrupt_or_mismatched_index_file_is_a_miss(index, tmp_path):
    path = tmp_path / "index.faiss"
    assert load_index(path, index.params) is None
    index.save(path, generation=1)
    other_kind = "hnsw" if index.params.kind == "flat" else "flat"
    assert load_index(path, IndexParams(kind=other_kind, dim=DIM)) is None
    path.write_bytes(path.read_bytes()[:100])
    assert load_index(path, index.params) is None
