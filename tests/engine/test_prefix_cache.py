"""The exact-prefix KV cache: a hit returns what was put, and it evicts the least recently used
prefix beyond its capacity."""

from __future__ import annotations

import torch

from engine.blend import PrefixKV
from engine.prefix_cache import PrefixCache


def kv(seed: int) -> PrefixKV:
    generator = torch.Generator().manual_seed(seed)
    return PrefixKV(
        keys=torch.randn(2, 2, 3, 4, generator=generator),
        values=torch.randn(2, 2, 3, 4, generator=generator),
    )


def test_a_miss_is_none_and_a_hit_returns_the_entry_put():
    cache = PrefixCache(capacity=2)
    entry = kv(0)
    assert cache.get((1, 2)) is None
    cache.put((1, 2), entry)
    assert cache.get((1, 2)) is entry
    assert cache.get((1,)) is None  # exact prefixes only, never a shorter or longer one


def test_beyond_capacity_the_least_recently_used_prefix_is_evicted():
    cache = PrefixCache(capacity=2)
    cache.put((1,), kv(1))
    cache.put((2,), kv(2))
    assert cache.get((1,)) is not None  # (1,) is now the most recently used
    cache.put((3,), kv(3))
    assert [cache.get(p) is not None for p in [(1,), (2,), (3,)]] == [True, False, True]


def test_putting_a_prefix_again_replaces_its_entry_and_refreshes_it():
    cache = PrefixCache(capacity=2)
    first, second = kv(1), kv(2)
    cache.put((1,), first)
    cache.put((2,), kv(3))
    cache.put((1,), second)
    cache.put((3,), kv(4))
    assert cache.get((1,)) is second
    assert cache.get((2,)) is None


def test_capacity_zero_caches_nothing():
    cache = PrefixCache(capacity=0)
    cache.put((1,), kv(0))
    assert cache.get((1,)) is None
