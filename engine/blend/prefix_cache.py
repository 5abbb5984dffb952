"""The exact prompt-prefix KV (system prompt and template start), like prefix caching: entries of
the KV store's fastest tier (gpu on CUDA, host memory on the CPU), never written to SSD."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstore.store import KVStore
from kvstore.types import ChunkKV, chunk_key


class PrefixCache:
    """At most `capacity` prefixes, least recently used dropped first; the tier's byte budget
    may drop them earlier. Without a store (or with capacity 0) nothing is cached."""

    def __init__(self, capacity: int = 16, store: KVStore | None = None, fingerprint: str = ""):
        self.capacity = capacity if store is not None else 0
        self.store = store
        self._namespace = f"{fingerprint}/prefix"
        # (cache salt, prefix) -> store key: a prefix cached under one salt (one tenant's) is
        # not found under another, so its first token's time tells no tenant another's prompt.
        self._keys: OrderedDict[tuple[str, tuple[int, ...]], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, prefix: tuple[int, ...], cache_salt: str = "") -> ChunkKV | None:
        """The prefix's KV (`rotated`: exact at positions 0..P-1), or None."""
        entry = (cache_salt, prefix)
        with self._lock:
            key = self._keys.get(entry)
            if key is None or self.store is None:
                return None
            self._keys.move_to_end(entry)
        kv = self.store.get_local(key)
        if kv is None:  # the tier evicted it for room
            with self._lock:
                self._keys.pop(entry, None)
            return None
        # The tier keeps tensors, not the flag; every entry put here is rotated.
        return ChunkKV(kv.keys, kv.values, rotated=True)

    def put(self, prefix: tuple[int, ...], kv: ChunkKV, cache_salt: str = "") -> None:
        assert kv.rotated, "the prefix cache holds exact, rotated prefix KV"
        if self.capacity <= 0 or self.store is None or not prefix:
            return
        key = chunk_key(self._namespace, prefix, cache_salt)
        if not self.store.put_local(key, kv):
            return
        entry = (cache_salt, prefix)
        with self._lock:
            self._keys[entry] = key
            self._keys.move_to_end(entry)
            evicted = []
            while len(self._keys) > self.capacity:
                evicted.append(self._keys.popitem(last=False)[1])
        for old in evicted:
            self.store.tiers[0].discard(old)
