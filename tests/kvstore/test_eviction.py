"""W-TinyLFU admission for the in-memory tiers: the frequency sketch's counts and aging, one
count per use of a key, a one-off scan that cannot evict a hot entry (it does under LRU)."""

from __future__ import annotations

import torch

from kvstore.eviction import COUNTER_MAX, FrequencySketch, TinyLFUPolicy
from kvstore.memory_tier import MemoryTier
from kvstore.types import ChunkKV


def kv(tokens: int = 4) -> ChunkKV:
    return ChunkKV(keys=torch.zeros(1, 1, tokens, 4), values=torch.zeros(1, 1, tokens, 4))


ENTRY_BYTES = kv().nbytes


def test_the_sketch_counts_accesses_and_saturates():
    sketch = FrequencySketch(64)
    for _ in range(3):
        sketch.increment("a")
    assert sketch.estimate("a") == 3 and sketch.estimate("never") == 0
    for _ in range(40):
        sketch.increment("b")
    assert sketch.estimate("b") == COUNTER_MAX


def test_the_sketch_halves_every_count_after_its_sample_of_increments():
    sketch = FrequencySketch(16)
    for _ in range(8):
        sketch.increment("hot")
    before = sketch.estimate("hot")
    for i in range(10 * sketch.capacity):
        sketch.increment(f"warm-{i % 4}")
    assert sketch.estimate("hot") <= before // 2 + 1 < before


def test_first_sightings_of_one_off_keys_do_not_age_the_sketch():
    sketch = FrequencySketch(1024)
    for _ in range(8):
        sketch.increment("hot")
    for i in range(10 * sketch.capacity):
        sketch.increment(f"one-off-{i}")
    assert sketch.estimate("hot") == 8


def test_a_missed_lookup_and_its_write_back_count_once():
    policy = TinyLFUPolicy(4 * ENTRY_BYTES)
    policy.access("missed", hit=False)
    policy.insert("missed", ENTRY_BYTES)
    policy.insert("put-only", ENTRY_BYTES)
    assert policy.sketch.estimate("missed") == policy.sketch.estimate("put-only") == 1
    policy.access("missed", hit=True)
    policy.insert("missed", ENTRY_BYTES)  # a put again, no lookup missed it: a use of its own
    assert policy.sketch.estimate("missed") == 3


def scan(tier: MemoryTier, hot: list[str], rounds: int) -> None:
    """The hot keys used again and again, between a stream of keys each used once."""
    for key in hot:
        tier.put(key, kv())
    for r in range(rounds):
        for key in hot:
            if tier.get(key) is None:
                tier.put(key, kv())
        for j in range(len(hot)):
            cold = f"cold-{r}-{j}"
            tier.get(cold)
            tier.put(cold, kv())


def test_a_one_off_scan_evicts_hot_entries_under_lru_but_not_under_tinylfu():
    hot = [f"hot-{i}" for i in range(8)]
    lru = MemoryTier(10 * ENTRY_BYTES, policy="lru")
    tiny = MemoryTier(10 * ENTRY_BYTES, policy="tinylfu")
    for tier in (lru, tiny):
        scan(tier, hot, rounds=20)
    assert sum(key in lru for key in hot) < len(hot) // 2
    assert sum(key in tiny for key in hot) >= len(hot) - 1


def test_tinylfu_never_holds_more_bytes_than_its_budget():
    tier = MemoryTier(7 * ENTRY_BYTES + 3, policy="tinylfu")
    for i in range(300):
        key = f"k{i % 37}" if i % 3 else f"new-{i}"
        if tier.get(key) is None:
            tier.put(key, kv(4 + i % 5))
        assert tier.stats().bytes <= 7 * ENTRY_BYTES + 3
