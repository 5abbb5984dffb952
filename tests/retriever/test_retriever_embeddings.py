"""The embedder on its own (the bundled MiniLM): long chunks averaged over windows, queries
truncated to one window, and a long encode that stops when told to (at shutdown)."""

from __future__ import annotations

import numpy as np
import pytest

from retriever.embeddings import BATCHES_PER_STOP_CHECK, Embedder, EmbeddingStoppedError


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(batch_size=2)


def test_a_query_is_truncated_while_a_chunk_is_averaged_over_windows(embedder):
    head = " ".join(f"beacon{i} on the hill" for i in range(200))  # past the 256-token window
    tail = " ".join(f"pasta{i} with basil" for i in range(400))
    long_text = head + " " + tail
    query = embedder.encode_query(long_text)
    assert query.shape == (1, embedder.info.dim)
    assert np.allclose(query, embedder.encode_query(head + " " + tail[:2000]), atol=1e-5)
    chunk = embedder.encode([long_text])
    assert float(chunk[0] @ query[0]) < 0.99  # the tail's windows count for the chunk


def test_a_long_encode_stops_between_batches_when_told_to(embedder):
    texts = [
        f"Sentence number {i} about the harbour." for i in range(5 * 2 * BATCHES_PER_STOP_CHECK)
    ]
    asked = []

    def stop_after_first_group() -> bool:
        asked.append(True)
        return len(asked) > 1

    with pytest.raises(EmbeddingStoppedError, match=f"after {2 * BATCHES_PER_STOP_CHECK} of"):
        embedder.encode(texts, stop_after_first_group)
    whole = embedder.encode(texts, lambda: False)
    assert whole.shape == (len(texts), embedder.info.dim)
    assert np.allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-5)
