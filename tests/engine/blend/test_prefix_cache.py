"""The exact-prefix KV cache: entries of the store's fastest tier; a hit returns what was put,
the least recently used prefix goes beyond its capacity, and nothing reaches the SSD."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.blend.prefix_cache import PrefixCache
from kvstore import tiers
from kvstore.store import KVStore, KVStoreConfig
from kvstore.types import ChunkKV

FINGERPRINT = "prefix-test-model"


def kv(seed: int) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    return ChunkKV(
        keys=torch.randn(2, 2, 3, 4, generator=generator),
        values=torch.randn(2, 2, 3, 4, generator=generator),
        rotated=True,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with KVStore(KVStoreConfig(model_fingerprint=FINGERPRINT, ssd_path=tmp_path / "kv")) as s:
        yield s


def _equal(a: ChunkKV | None, b: ChunkKV) -> bool:
    return a is not None and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_miss_is_none_and_a_hit_returns_the_entry_put(store: KVStore):
    cache = PrefixCache(capacity=2, store=store, fingerprint=FINGERPRINT)
    entry = kv(0)
    assert cache.get((1, 2)) is None
    cache.put((1, 2), entry)
    assert _equal(cache.get((1, 2)), entry)
    assert cache.get((1,)) is None  # exact prefixes only, never a shorter or longer one


def test_prefix_entries_live_in_the_fastest_tier_and_never_reach_the_ssd(store: KVStore):
    cache = PrefixCache(capacity=2, store=store, fingerprint=FINGERPRINT)
    cache.put((1, 2), kv(0))
    store.flush()
    stats = store.stats()
    assert stats.tiers[tiers.MEMORY].entries == 1
    assert stats.tiers[tiers.SSD].entries == 0


def test_a_gpu_tier_takes_the_prefix_entries_when_there_is_one(tmp_path: Path):
    config = KVStoreConfig(model_fingerprint=FINGERPRINT, gpu_budget_bytes=1 << 20)
    with KVStore(config) as store:
        cache = PrefixCache(capacity=2, store=store, fingerprint=FINGERPRINT)
        cache.put((1, 2), kv(0))
        assert store.stats().tiers[tiers.GPU].entries == 1
        assert store.stats().tiers[tiers.MEMORY].entries == 0


def test_beyond_capacity_the_least_recently_used_prefix_is_evicted(store: KVStore):
    cache = PrefixCache(capacity=2, store=store, fingerprint=FINGERPRINT)
    cache.put((1,), kv(1))
    cache.put((2,), kv(2))
    assert cache.get((1,)) is not None  # (1,) is now the most recently used
    cache.put((3,), kv(3))
    assert [cache.get(p) is not None for p in [(1,), (2,), (3,)]] == [True, False, True]
    assert store.stats().tiers[tiers.MEMORY].entries == 2


def test_putting_a_prefix_again_replaces_its_entry_and_refreshes_it(store: KVStore):
    cache = PrefixCache(capacity=2, store=store, fingerprint=FINGERPRINT)
    first, second = kv(1), kv(2)
    cache.put((1,), first)
    cache.put((2,), kv(3))
    cache.put((1,), second)
    cache.put((3,), kv(4))
    assert _equal(cache.get((1,)), second)
    assert cache.get((2,)) is None


def test_an_entry_the_tier_evicted_for_room_is_a_miss():
    entry = kv(0)
    budget = entry.keys.nbytes + entry.values.nbytes
    # lru: the new entry always takes the room (tinylfu may keep the old one instead).
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT, memory_budget_bytes=budget, memory_policy="lru"
    )
    with KVStore(config) as s:
        cache = PrefixCache(capacity=4, store=s, fingerprint=FINGERPRINT)
        cache.put((1,), entry)
        cache.put((2,), kv(1))  # the tier holds one entry: (1,) goes
        assert cache.get((1,)) is None and cache.get((2,)) is not None


def test_capacity_zero_or_no_store_caches_nothing(store: KVStore):
    for cache in (PrefixCache(capacity=0, store=store), PrefixCache(capacity=2)):
        cache.put((1,), kv(0))
        assert cache.get((1,)) is None


def test_a_prefix_cached_under_one_salt_is_not_found_under_another(store: KVStore):
    cache = PrefixCache(capacity=4, store=store, fingerprint=FINGERPRINT)
    entry = kv(0)
    cache.put((1, 2), entry, "tenant-a")
    assert _equal(cache.get((1, 2), "tenant-a"), entry)
    assert cache.get((1, 2), "tenant-b") is None
    assert cache.get((1, 2)) is None
