"""Retrieval modes, and reciprocal rank fusion (Cormack et al., 2009) that merges the dense and
BM25 rankings by the sum of 1 / (k + rank) over the lists an id appears in (rank from 1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

# dense: cosine over the FAISS index; bm25: SQLite FTS5 over chunk text; hybrid: both, fused.
RetrievalMode = Literal["dense", "bm25", "hybrid"]
RETRIEVAL_MODES: tuple[RetrievalMode, ...] = ("dense", "bm25", "hybrid")


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: float) -> list[tuple[int, float]]:
    """(id, fused score) best first; ties keep the order of first appearance (the first list
    wins), so the fusion is deterministic."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda pair: -pair[1])
