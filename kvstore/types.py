"""Types shared by the KV tiers and their consumer (the engine): a chunk's KV, its key, and the
layer-by-layer stream the blender reads from."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


def chunk_key(model_fingerprint: str, token_ids: Sequence[int]) -> str:
    """The store key of one chunk: a hash of the model fingerprint and the chunk's token ids."""
    digest = hashlib.sha256(model_fingerprint.encode())
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ChunkKV:
    """The standalone KV cache of one chunk, every layer.

    keys and values: [num_layers, num_kv_heads, num_tokens, head_dim]; keys are stored before
    RoPE (`positions = "pre_rope"`), so the engine can rotate them to any final position.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        assert self.keys.shape == self.values.shape, (self.keys.shape, self.values.shape)
        assert self.keys.dim() == 4 and self.keys.dtype == self.values.dtype

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]


@dataclass
class LayerLoad:
    """When the KV of one layer (all chunks of a request) was loaded.

    Times are time.perf_counter() seconds."""

    layer: int
    load_start_s: float
    load_end_s: float
    bytes_loaded: int = 0


@dataclass
class StreamStats:
    """What one stream read, by tier."""

    bytes_by_tier: dict[str, int] = field(default_factory=dict)


class LayerStream(Protocol):
    """KV of a fixed list of chunks, delivered layer by layer.

    `present[j]` says whether chunk j was found (a miss is simply absent from every layer).
    `layer(i)` blocks until layer i of every present chunk is on the stream's device and returns
    one (keys, values) pair per present chunk, in request order, each [num_kv_heads, n_j, head_dim].
    Layers must be asked for in increasing order; a loader may run ahead.
    """

    present: list[bool]
    tiers: list[str | None]
    timings: list[LayerLoad]

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


@dataclass
class TierStats:
    """Counters of one tier; `corrupt` counts entries dropped because they failed a check."""

    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
