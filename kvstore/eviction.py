"""Eviction and admission for the in-memory tiers, on keys and byte sizes only (no tensors):
plain LRU, and W-TinyLFU (a window LRU, an SLRU main segment, a count-min frequency sketch)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Literal, Protocol

PolicyName = Literal["lru", "tinylfu"]
POLICIES: tuple[PolicyName, ...] = ("lru", "tinylfu")

COUNTER_MAX = 15  # 4-bit saturating counters, as in TinyLFU
DEPTH = 4
# Missed keys remembered for their write-back put at least (requests in flight between the two).
MISSED_KEYS_MIN = 1024


class FrequencySketch:
    """Count-min sketch of access counts: DEPTH rows of 4-bit-style saturating counters. After
    10 x capacity increments of keys seen before every counter is halved (aging), so old
    popularity fades; a first sighting (every counter of the key 0) does not bring aging closer.

    It grows (and starts over) when the tier holds more entries than it was sized for: byte
    budgets give no entry count up front."""

    def __init__(self, capacity: int = 16) -> None:
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        self.capacity = 1 << max(4, (capacity - 1).bit_length())
        # 8 counters per row per expected entry: under churn most keys of a sample are one-offs,
        # and wide rows keep their collisions off the warm keys' counts (and a new key at 0).
        self._width = 8 * self.capacity
        self._table = bytearray(DEPTH * self._width)
        self._sample_size = 10 * self.capacity
        self._additions = 0

    def ensure_capacity(self, entries: int) -> None:
        if entries > self.capacity:
            self._reset(2 * entries)

    def _counter_indices(self, key: str) -> list[int]:
        # A stable hash (str.__hash__ is salted per process): runs and benchmarks repeat.
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        h1, h2 = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1
        mask = self._width - 1
        return [row * self._width + ((h1 + row * h2) & mask) for row in range(DEPTH)]

    def estimate(self, key: str) -> int:
        return min(self._table[i] for i in self._counter_indices(key))

    def increment(self, key: str) -> None:
        counters = self._counter_indices(key)
        low = min(self._table[i] for i in counters)
        if low < COUNTER_MAX:
            # Conservative update: only the lowest counters, so collisions inflate less.
            for i in counters:
                if self._table[i] == low:
                    self._table[i] = low + 1
        # Only keys seen before age the sketch: a stream of one-off keys would otherwise halve
        # the warm keys' counts before they recur. It cannot stall aging for long: as one-offs
        # fill the table, a new key's counters collide with theirs and are no longer all 0.
        if low > 0:
            self._additions += 1
        if self._additions >= self._sample_size:
            self._table = bytearray(count >> 1 for count in self._table)
            self._additions //= 2


class EvictionPolicy(Protocol):
    """What a MemoryTier asks its policy, under the tier's lock."""

    nbytes: int

    def access(self, key: str, hit: bool) -> None: ...

    def insert(self, key: str, nbytes: int) -> list[str]: ...

    def remove(self, key: str) -> None: ...

    def order(self) -> list[str]: ...


class LRUPolicy:
    """Least recently used first, by bytes: a put evicts from the LRU end until it fits."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def access(self, key: str, hit: bool) -> None:
        if hit:
            self._sizes.move_to_end(key)

    def insert(self, key: str, nbytes: int) -> list[str]:
        """Store `key` (nbytes <= budget) as most recently used; the keys evicted, LRU first."""
        self.remove(key)
        evicted = []
        while self.nbytes + nbytes > self.budget_bytes:
            victim, size = self._sizes.popitem(last=False)
            self.nbytes -= size
            evicted.append(victim)
        self._sizes[key] = nbytes
        self.nbytes += nbytes
        return evicted

    def remove(self, key: str) -> None:
        self.nbytes -= self._sizes.pop(key, 0)

    def order(self) -> list[str]:
        return list(self._sizes)


class TinyLFUPolicy:
    """W-TinyLFU by bytes. A new key enters the window LRU (`window_share` of the budget);
    what leaves the window moves to the main segment's probation part while the budget has
    room. When it has none, the window's LRU entry is a candidate against the main segment's
    victims, taken in eviction order (probation LRU first, then protected LRU) until their
    bytes cover the excess: it is admitted, and they evicted, only if its estimated frequency
    beats every one of theirs (a tie keeps the victim); otherwise the candidate is dropped.
    Beating all of them, not the first, keeps a large one-off from displacing several warm
    entries. A hit in probation moves the entry to protected (`protected_share` of the main
    segment; its LRU entry is demoted back to probation). Each use of a key counts once in the
    sketch: an access, or a put, but not the put that follows the key's own missed lookup
    (the write-back of the request that missed it). A put of a key already held starts it over
    in the window, its count kept."""

    def __init__(
        self, budget_bytes: int, window_share: float = 0.01, protected_share: float = 0.8
    ) -> None:
        self.budget_bytes = budget_bytes
        self.window_bytes = int(budget_bytes * window_share)
        self.protected_bytes = int((budget_bytes - self.window_bytes) * protected_share)
        self.nbytes = 0
        self.sketch = FrequencySketch()
        self._window: OrderedDict[str, int] = OrderedDict()
        self._probation: OrderedDict[str, int] = OrderedDict()
        self._protected: OrderedDict[str, int] = OrderedDict()
        self._used = {id(s): 0 for s in (self._window, self._probation, self._protected)}
        # Keys counted by a missed lookup and not put since, the oldest first, at most
        # max(MISSED_KEYS_MIN, sketch capacity): past that, a late put counts once more.
        self._missed: OrderedDict[str, None] = OrderedDict()

    def access(self, key: str, hit: bool) -> None:
        self.sketch.increment(key)
        if not hit:
            self._missed[key] = None
            self._missed.move_to_end(key)
            while len(self._missed) > max(MISSED_KEYS_MIN, self.sketch.capacity):
                self._missed.popitem(last=False)
            return
        if key in self._probation:
            self._move(key, self._probation, self._protected)
            while self._used[id(self._protected)] > self.protected_bytes:
                demoted = next(iter(self._protected))
                self._move(demoted, self._protected, self._probation)
        else:
            segment = self._window if key in self._window else self._protected
            segment.move_to_end(key)

    def insert(self, key: str, nbytes: int) -> list[str]:
        """Store `key` (nbytes <= budget) in the window; the keys evicted or not admitted (the
        new key among them when it lost), in that order."""
        self.remove(key)
        if self._missed.pop(key, 0) is not None:  # None: its missed lookup counted it
            self.sketch.increment(key)
        self._add(key, nbytes, self._window)
        self.sketch.ensure_capacity(len(self))
        dropped: list[str] = []
        while self._window and (
            self._used[id(self._window)] > self.window_bytes or self.nbytes > self.budget_bytes
        ):
            candidate = next(iter(self._window))
            if self.nbytes <= self.budget_bytes:
                self._move(candidate, self._window, self._probation)
                continue
            victims = self._victims(self.nbytes - self.budget_bytes)
            frequency = self.sketch.estimate(candidate)
            if victims and all(frequency > self.sketch.estimate(v) for v in victims):
                for victim in victims:
                    self.remove(victim)
                dropped.extend(victims)
                self._move(candidate, self._window, self._probation)
            else:
                self.remove(candidate)
                dropped.append(candidate)
        return dropped

    def remove(self, key: str) -> None:
        for segment in (self._window, self._probation, self._protected):
            size = segment.pop(key, None)
            if size is not None:
                self._used[id(segment)] -= size
                self.nbytes -= size
                return

    def order(self) -> list[str]:
        """Main segment's victims in eviction order, then the window, LRU first."""
        return [*self._probation, *self._protected, *self._window]

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def _victims(self, need: int) -> list[str]:
        """The main segment's first victims whose bytes cover `need`; [] if they cannot."""
        victims: list[str] = []
        freed = 0
        for segment in (self._probation, self._protected):
            for victim, size in segment.items():
                if freed >= need:
                    return victims
                victims.append(victim)
                freed += size
        return victims if freed >= need else []

    def _add(self, key: str, nbytes: int, segment: OrderedDict[str, int]) -> None:
        segment[key] = nbytes
        self._used[id(segment)] += nbytes
        self.nbytes += nbytes

    def _move(self, key: str, source: OrderedDict[str, int], to: OrderedDict[str, int]) -> None:
        size = source.pop(key)
        self._used[id(source)] -= size
        to[key] = size
        self._used[id(to)] += size


def make_policy(name: PolicyName, budget_bytes: int) -> LRUPolicy | TinyLFUPolicy:
    if name == "lru":
        return LRUPolicy(budget_bytes)
    if name == "tinylfu":
        return TinyLFUPolicy(budget_bytes)
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
