"""The memory tier under policy="lru": LRU by bytes with an exact eviction order."""

from __future__ import annotations

import pytest
import torch

from kvstore.memory_tier import MemoryTier
from tests.kvstore.kv_testutil import assert_kv_equal, make_kv

ENTRY = make_kv().nbytes  # every entry below has the same size


def _tier_with(keys: list[str], budget_entries: int) -> MemoryTier:
    tier = MemoryTier(budget_bytes=budget_entries * ENTRY, policy="lru")
    for i, key in enumerate(keys):
        assert tier.put(key, make_kv(seed=i)) == []
    return tier


def test_put_over_budget_evicts_least_recently_used_first() -> None:
    tier = _tier_with(["a", "b", "c"], budget_entries=3)
    assert tier.put("d", make_kv(seed=9)) == ["a"]
    assert tier.keys_lru_first() == ["b", "c", "d"]


def test_get_refreshes_recency_so_eviction_order_follows_use() -> None:
    tier = _tier_with(["a", "b", "c"], budget_entries=3)
    assert tier.get("a") is not None
    assert tier.get("b") is not None
    assert tier.put("d", make_kv(seed=9)) == ["c"]
    assert tier.put("e", make_kv(seed=9)) == ["a"]
    assert tier.keys_lru_first() == ["b", "d", "e"]


def test_a_large_entry_evicts_several_in_lru_order() -> None:
    tier = _tier_with(["a", "b", "c"], budget_entries=3)
    big = make_kv(num_tokens=10)  # twice the size of the others
    assert tier.put("big", big) == ["a", "b"]
    assert tier.stats().bytes == ENTRY + big.nbytes


def test_entry_larger_than_budget_is_not_stored_and_evicts_nothing() -> None:
    tier = _tier_with(["a"], budget_entries=1)
    assert tier.put("big", make_kv(num_tokens=50)) == []
    assert tier.keys_lru_first() == ["a"]


def test_replacing_a_key_counts_its_bytes_once() -> None:
    tier = _tier_with(["a", "b"], budget_entries=2)
    assert tier.put("a", make_kv(seed=5)) == []
    assert tier.keys_lru_first() == ["b", "a"]
    assert tier.stats().bytes == 2 * ENTRY
    assert_kv_equal(tier.get("a"), make_kv(seed=5))


def test_hits_misses_and_evictions_are_counted() -> None:
    tier = _tier_with(["a"], budget_entries=1)
    tier.get("a")
    tier.get("zz")
    tier.put("b", make_kv())
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (1, 1, 1, 1)


def test_pin_memory_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is allowed")
    with pytest.raises(ValueError, match="pin_memory"):
        MemoryTier(budget_bytes=1, pin_memory=True)
