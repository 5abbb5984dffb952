"""The in-memory tiers: whole chunk entries in host RAM (pinned when the engine is on CUDA) or
in device memory (the gpu tier), under a byte budget kept by an LRU or W-TinyLFU policy."""

from __future__ import annotations

import logging
import threading

import torch

from kvstore import tiers
from kvstore.eviction import PolicyName, make_policy
from kvstore.tiers import MemorySource
from kvstore.types import ChunkKV, TierStats

logger = logging.getLogger(__name__)


class MemoryTier:
    """ChunkKV by bytes on one device. Thread-safe. `policy` (kvstore/eviction.py) picks what
    is kept: "tinylfu", whose frequency-aware admission may turn a new entry away (`put` then
    returns its key) so that one-off chunks do not flush the warm ones, or plain "lru"
    (bench/results/cache_churn.md measures both).

    The host tier (`name=tiers.MEMORY`, device "cpu") keeps entries in pinned memory when
    `pin_memory`; the gpu tier (`name=tiers.GPU`, a CUDA device) keeps them where the blend
    reads them, so a hit costs no copy at all.
    """

    promotable = False  # the fastest tiers: nothing faster to copy an entry to

    def __init__(
        self,
        budget_bytes: int,
        pin_memory: bool = False,
        *,
        name: str = tiers.MEMORY,
        device: torch.device | str = "cpu",
        policy: PolicyName = "tinylfu",
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory needs a CUDA build of torch with a visible GPU")
        self.name = name
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self._entries: dict[str, ChunkKV] = {}
        self._policy = make_policy(policy, budget_bytes)
        self._stats = TierStats(budget_bytes=budget_bytes)
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def keys_lru_first(self) -> list[str]:
        """The keys, the first to be evicted first (under lru: least recently used first)."""
        with self._lock:
            return self._policy.order()

    def get(self, key: str) -> ChunkKV | None:
        """The entry, now most recently used, or None on a miss (counted)."""
        with self._lock:
            kv = self._entries.get(key)
            self._policy.access(key, hit=kv is not None)
            if kv is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            return kv

    def open(self, key: str) -> MemorySource | None:
        """A layer source over the entry (views, no copy), or None on a miss (counted)."""
        kv = self.get(key)
        return None if kv is None else MemorySource(key, kv, self.name)

    def put(self, key: str, kv: ChunkKV) -> list[str]:
        """Store `kv` (moved to this tier's device, pinned if configured); returns the keys
        evicted for room in eviction order, `key` among them when the policy did not admit
        it. An entry larger than the whole budget is not stored."""
        if kv.nbytes > self.budget_bytes:
            logger.debug("entry %s (%d bytes) is over the %s budget", key, kv.nbytes, self.name)
            return []
        kv = self._to_device(kv)
        with self._lock:
            self._entries[key] = kv
            evicted = self._policy.insert(key, kv.nbytes)
            for victim in evicted:
                del self._entries[victim]
            self._stats.evictions += len(evicted)
        return evicted

    def discard(self, key: str) -> bool:
        with self._lock:
            kv = self._entries.pop(key, None)
            self._policy.remove(key)
            return kv is not None

    def report_error(self, key: str, error: BaseException) -> None:
        """Nothing to do: a read of memory fails only by a bug, which the entry did not cause."""

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.entries, self._stats.bytes = len(self._entries), self._policy.nbytes
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        """Nothing to release: the entries go with the tier."""

    def _to_device(self, kv: ChunkKV) -> ChunkKV:
        keys, values = kv.keys.detach().to(self.device), kv.values.detach().to(self.device)
        if self.pin_memory and not keys.is_pinned():
            keys, values = keys.pin_memory(), values.pin_memory()
        if keys is kv.keys and values is kv.values:
            return kv
        return ChunkKV(keys=keys, values=values)
