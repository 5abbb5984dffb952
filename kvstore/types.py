"""Types shared by the KV tiers and their consumer (the engine): a chunk's KV, its key, and the
layer-by-layer stream the blender reads from."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvstore.device_time import DeviceSpan

_KEY_RE = re.compile(r"[0-9A-Za-z_-]{2,200}")


def is_valid_key(key: object) -> bool:
    """Whether `key` can be a store key: it names files and remote values."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def validate_key(key: str) -> str:
    """`key` when it is a valid store key, else ValueError."""
    if not is_valid_key(key):
        raise ValueError(f"key {key!r} is not 2-200 characters of [0-9A-Za-z_-]")
    return key


def chunk_key(model_fingerprint: str, token_ids: Sequence[int], cache_salt: str = "") -> str:
    """The store key of one chunk: a hash of the model fingerprint, the chunk's token ids and
    its cache salt (its tenant's scope: the same tokens under two salts are two entries in
    every tier, so one tenant's KV never answers another's lookup). The empty salt keeps the
    key of an unsalted chunk."""
    namespace = model_fingerprint
    if cache_salt:
        # "/" cannot occur in a fingerprint (hex): no salted namespace equals an unsalted one.
        namespace += "/salt/" + hashlib.sha256(cache_salt.encode()).hexdigest()
    digest = hashlib.sha256(namespace.encode())
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


def kv_token_bytes(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_layers: int = 1
) -> int:
    """Bytes of one token's keys and values over `num_layers` layers, as the model holds them."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class ChunkKV:
    """The KV cache of a run of tokens, every layer: a chunk's standalone KV, or (`rotated`) an
    exact prompt prefix's.

    keys and values: [num_layers, num_kv_heads, num_tokens, head_dim]. A chunk's keys are kept
    before RoPE (`positions = "pre_rope"`), so the engine can rotate them to any final position;
    `rotated` keys are after RoPE, at positions 0..num_tokens-1, and usable only there.
    """

    keys: torch.Tensor
    values: torch.Tensor
    rotated: bool = False

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


@dataclass(frozen=True)
class LayerKV(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """One layer of the KV of a stream's present chunks as one tensor pair: `keys` and `values`
    [H_kv, N, D], the chunks' tokens back to back in request order (`lengths` each). Also a
    sequence of (keys, values) per chunk, views of the pair."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        index = range(len(self.lengths))[index]  # negative indices, and IndexError
        start = sum(self.lengths[:index])
        end = start + self.lengths[index]
        return self.keys[:, start:end], self.values[:, start:end]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[j] for j in range(len(self.lengths)))


NO_CHUNKS = LayerKV(torch.empty(0), torch.empty(0), ())


@dataclass
class LayerLoad:
    """When the KV of one layer (all chunks of a request) was loaded, in time.perf_counter()
    seconds, and `seconds`: how long loading it took where the work ran (the host's reads and
    packing, or the device's copy if longer: CUDA events), known once the copy is done."""

    layer: int
    load_start_s: float
    load_end_s: float
    bytes_loaded: int = 0
    device_span: DeviceSpan | None = None

    def seconds(self) -> float | None:
        """max(host seconds, device seconds); None until the device finished the copy."""
        host = self.load_end_s - self.load_start_s
        if self.device_span is None:
            return host
        device = self.device_span.seconds()
        return None if device is None else max(host, device)


@dataclass
class StreamStats:
    """What one stream read, by tier, and the host-to-device copies that moved it (one per
    layer when coalesced)."""

    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    device_copies: int = 0
    device_copy_bytes: int = 0


class LayerStream(Protocol):
    """KV of a fixed list of chunks, delivered layer by layer.

    `present[j]` says whether chunk j was found (a miss is simply absent from every layer).
    `layer(i)` blocks until layer i of every present chunk is on the stream's device and returns
    it as one LayerKV: keys and values [num_kv_heads, N, head_dim], the present chunks' tokens
    in request order. Layers must be asked for in increasing order; a loader may run ahead.
    """

    present: list[bool]
    tiers: list[str | None]
    timings: list[LayerLoad]

    def layer(self, index: int) -> LayerKV: ...

    def close(self) -> None: ...


@dataclass
class TierStats:
    """Counters of one tier; `corrupt` counts entries dropped because they failed a check.

    Entries, bytes and budget are None where the tier cannot know them (the remote tier: Redis
    holds the entries of every engine and evicts them itself). `bytes_written` counts what this
    process wrote to the tier; `reachable` and `last_error` say whether its backend answers
    (only the remote tier can be unreachable) and why the last operation failed."""

    entries: int | None = 0
    bytes: int | None = 0
    budget_bytes: int | None = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes_written: int = 0
    reachable: bool = True
    last_error: str | None = None
