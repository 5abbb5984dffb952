"""The KV tiers by name, in lookup order, with the interface every tier implements: the one
place tier names are spelled out (the engine, the controller and the metrics import them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.loader import LayerSource
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


class Tier(Protocol):
    """One level of the store. Thread-safe. `open` returns a layer source for a hit (a miss or
    a bad entry is None: logged, counted, deleted); `put` returns the keys evicted for room."""

    name: str

    def __contains__(self, key: str) -> bool: ...

    def open(self, key: str) -> LayerSource | None: ...

    def put(self, key: str, kv: ChunkKV) -> list[str]: ...

    def discard(self, key: str) -> bool: ...

    def stats(self) -> TierStats: ...
