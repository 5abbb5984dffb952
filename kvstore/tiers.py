"""The KV tiers by name, in lookup order, with the interfaces every tier and its layer sources
implement: the one place tier names are spelled out (engine, controller and metrics use them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.codec import QuantizedPair

if TYPE_CHECKING:
    from kvstore.format import EncodedEntry
    from kvstore.types import ChunkKV, TierStats

GPU = "gpu"  # device memory, CUDA only: a hit costs no copy
MEMORY = "memory"  # host memory, pinned on CUDA; plays the gpu tier's role on the CPU
SSD = "ssd"  # files on local disk
REMOTE = "remote"  # shared by every engine (Redis)

# Fastest first: the store walks its tiers in this order and the first hit serves.
ORDER = (GPU, MEMORY, SSD, REMOTE)
# Written through in the background; entries there survive a restart.
PERSISTENT = (SSD, REMOTE)

# Read speed assumed for a tier before anything was measured (bytes per second): conservative
# figures for device memory, pinned host memory over PCIe, an NVMe SSD and a 10 GbE network.
PRIOR_BYTES_PER_S = {GPU: 1e12, MEMORY: 8e9, SSD: 1e9, REMOTE: 0.5e9}


def rank(tier: str) -> int:
    """Position of `tier` in ORDER; an unknown tier ranks last (slowest)."""
    return ORDER.index(tier) if tier in ORDER else len(ORDER)


def slowest(tiers: list[str | None]) -> str | None:
    """The slowest tier among `tiers` (None entries are misses and ignored)."""
    present = [t for t in tiers if t is not None]
    return max(present, key=rank) if present else None


KVPair = tuple[torch.Tensor, torch.Tensor]
# What a source hands the loader for one layer: K and V, or (compressed tiers) their payload
# and scales, which travel compressed and are dequantized on the device.
LayerItem = KVPair | QuantizedPair


class LayerSource(Protocol):
    """One present chunk as the loader reads it; `read_layer` may raise KVEntryError/OSError."""

    key: str
    tier: str
    num_layers: int

    def read_layer(self, layer: int) -> LayerItem: ...

    def close(self) -> None: ...


class MemorySource:
    """A chunk held by an in-memory tier: a layer is a pair of views, no copy."""

    def __init__(self, key: str, kv: ChunkKV, tier: str = MEMORY) -> None:
        self.key = key
        self.kv = kv
        self.tier = tier
        self.num_layers = kv.num_layers

    def read_layer(self, layer: int) -> KVPair:
        return self.kv.layer(layer)

    def close(self) -> None:
        """Nothing to release; the tier owns the tensors."""


class Tier(Protocol):
    """One level of the store. Thread-safe. `open` returns a layer source for a hit (a miss or
    a bad entry is None: logged, counted, deleted); `put` returns the keys evicted for room.

    `promotable`: an entry read from this tier is copied to the faster ones once read (the
    persistent tiers). `report_error` hears that a read of one of its sources failed, and
    deletes the entry when the entry is at fault."""

    name: str
    promotable: bool

    def __contains__(self, key: str) -> bool: ...

    def open(self, key: str) -> LayerSource | None: ...

    def put(self, key: str, kv: ChunkKV) -> list[str]: ...

    def discard(self, key: str) -> bool: ...

    def report_error(self, key: str, error: BaseException) -> None: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


class PersistentTier(Tier, Protocol):
    """A tier the store writes through to (SSD, remote): it takes an entry already encoded, so
    that one encode serves every persistent tier and a promoted entry is not encoded again."""

    def write(self, entry: EncodedEntry) -> list[str]: ...
