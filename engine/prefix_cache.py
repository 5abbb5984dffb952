"""An LRU of exact prompt-prefix KV (system prompt and template start), like prefix caching."""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.blend import PrefixKV


class PrefixCache:
    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], PrefixKV] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, prefix: tuple[int, ...]) -> PrefixKV | None:
        with self._lock:
            entry = self._entries.get(prefix)
            if entry is not None:
                self._entries.move_to_end(prefix)
            return entry

    def put(self, prefix: tuple[int, ...], kv: PrefixKV) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[prefix] = kv
            self._entries.move_to_end(prefix)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
