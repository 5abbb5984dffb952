"""The KVStore facade: tiers by lookup, exact round trips, promotion, restart, background
write-through (including a failed write), check(), and concurrent use from several threads."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from kvstore import store as kvstore_store
from kvstore import tiers
from kvstore.eviction import PolicyName
from kvstore.memory_tier import MemoryTier
from kvstore.store import KVStore, KVStoreConfig
from kvstore.types import ChunkKV
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, key_of, make_kv, read_entry

KEYS = [key_of(i) for i in range(40)]


def _config(
    tmp_path: Path | None, memory_entries: int = 100, memory_policy: PolicyName = "tinylfu"
) -> KVStoreConfig:
    return KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=memory_entries * make_kv().nbytes,
        ssd_path=None if tmp_path is None else tmp_path / "kv",
        ssd_budget_bytes=1 << 30,
        memory_policy=memory_policy,
    )


def test_put_then_read_is_exact_in_memory_and_after_restart(tmp_path: Path, dtype) -> None:
    kv = make_kv(seed=11, dtype=dtype)
    with KVStore(_config(tmp_path)) as store:
        store.put(KEYS[0], kv)
        assert store.lookup([KEYS[0], KEYS[1]]) == ["memory", None]
        assert_kv_equal(read_entry(store, KEYS[0]), kv)
    with KVStore(_config(tmp_path)) as restarted:
        assert restarted.lookup([KEYS[0]]) == ["ssd"]
        assert_kv_equal(read_entry(restarted, KEYS[0]), kv)
        restarted.flush()
        assert restarted.lookup([KEYS[0]]) == ["memory"]  # the read promoted it


def test_memory_eviction_keeps_entries_readable_from_ssd(tmp_path: Path) -> None:
    # lru: the expected tiers follow its exact eviction order.
    with KVStore(_config(tmp_path, memory_entries=2, memory_policy="lru")) as store:
        for i in range(3):
            store.put(KEYS[i], make_kv(seed=i))
        store.flush()
        assert store.lookup(KEYS[:3]) == ["ssd", "memory", "memory"]
        assert_kv_equal(read_entry(store, KEYS[0]), make_kv(seed=0))
        store.flush()
        assert store.lookup(KEYS[:3]) == ["memory", "ssd", "memory"]


@pytest.mark.parametrize(
    ("policy", "held"),
    [("lru", [None, tiers.MEMORY, tiers.MEMORY]), ("tinylfu", [tiers.MEMORY, tiers.MEMORY, None])],
)
def test_the_memory_policy_decides_whether_a_new_entry_evicts_a_warm_one(
    policy: PolicyName, held: list[str | None]
) -> None:
    with KVStore(_config(None, memory_entries=2, memory_policy=policy)) as store:
        for i in range(2):
            store.put(KEYS[i], make_kv(seed=i))
        for _ in range(3):
            for key in KEYS[:2]:
                assert read_entry(store, key) is not None
        assert read_entry(store, KEYS[2]) is None  # a one-off chunk: missed, then written back
        store.put(KEYS[2], make_kv(seed=2))
        assert store.lookup(KEYS[:3]) == held


def test_the_memory_policy_is_that_of_the_gpu_tier_too_and_must_be_known() -> None:
    for policy in ("lru", "tinylfu"):
        config = KVStoreConfig(
            model_fingerprint=FINGERPRINT, gpu_budget_bytes=1 << 20, memory_policy=policy
        )
        with KVStore(config) as store:
            for name in (tiers.MEMORY, tiers.GPU):
                tier = store.tier(name)
                assert isinstance(tier, MemoryTier) and tier.policy == policy
    with pytest.raises(ValueError, match="memory_policy"):
        KVStoreConfig(model_fingerprint=FINGERPRINT, memory_policy="lfu")  # type: ignore[arg-type]


def test_memory_only_store_works_without_ssd() -> None:
    with KVStore(_config(None)) as store:
        store.put(KEYS[0], make_kv())
        store.flush()
        assert store.lookup([KEYS[0], KEYS[1]]) == ["memory", None]
        assert read_entry(store, KEYS[1]) is None
        assert store.stats().tier(tiers.SSD) is None


def test_failed_ssd_write_is_counted_and_entry_stays_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVStore(_config(tmp_path)) as store:

        def disk_full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        written = store.put(KEYS[0], make_kv())
        assert written.result(timeout=10) is False
        monkeypatch.undo()
        stats = store.stats()
        assert (stats.write_errors, stats.pending_writes, stats.tiers[tiers.SSD].entries) == (
            1,
            0,
            0,
        )
        assert stats.last_write_error == "ENOSPC: No space left on device"
        assert store.lookup([KEYS[0]]) == ["memory"]
        assert list((tmp_path / "kv").glob("*/*")) == []
        # The disk has room again: the next write succeeds and clears the failing state.
        assert store.put(KEYS[1], make_kv(seed=1)).result(timeout=10) is True
        assert store.stats().last_write_error is None and store.stats().write_errors == 1


def test_a_file_where_the_ssd_folder_was_fails_writes_without_naming_paths(
    tmp_path: Path,
) -> None:
    with KVStore(_config(tmp_path)) as store:
        (tmp_path / "kv").rmdir()
        (tmp_path / "kv").write_text("not a folder")  # e.g. an operator's mistake
        assert store.put(KEYS[0], make_kv()).result(timeout=10) is False
        stats = store.stats()
        assert stats.write_errors == 1 and stats.last_write_error is not None
        assert str(tmp_path) not in stats.last_write_error
        assert store.lookup([KEYS[0]]) == ["memory"]


def test_put_reports_when_the_entry_reached_the_last_tier(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        first, again = store.put(KEYS[0], make_kv()), store.put(KEYS[0], make_kv())
        assert first.result(timeout=10) is True and again.result(timeout=10) is True
        assert store.put(KEYS[0], make_kv()).result(timeout=0) is True  # on SSD already
    with KVStore(_config(None, memory_entries=1)) as memory_only:
        assert memory_only.put(KEYS[0], make_kv()).result(timeout=0) is True
        too_big = make_kv(num_tokens=64)
        assert too_big.nbytes > make_kv().nbytes
        assert memory_only.put(KEYS[1], too_big).result(timeout=0) is False


def test_bad_ssd_entry_is_a_miss_through_the_store(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        store.put(KEYS[0], make_kv())
        store.flush()
        store.tier(tiers.MEMORY).discard(KEYS[0])
        path = store.tier(tiers.SSD).file_path(KEYS[0])
        os.truncate(path, 100)
        assert read_entry(store, KEYS[0]) is None
        assert store.lookup([KEYS[0]]) == [None] and not path.exists()
        stats = store.stats()
        assert (
            stats.tiers[tiers.SSD].corrupt,
            stats.tiers[tiers.SSD].misses,
            stats.tiers[tiers.MEMORY].misses,
        ) == (1, 1, 1)


def test_check_reports_file_deleted_behind_the_index(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        store.put(KEYS[0], make_kv())
        store.put(KEYS[1], make_kv(seed=1))
        store.flush()
        store.tier(tiers.SSD).file_path(KEYS[0]).unlink()
        report = store.check()
        assert report.dropped_missing == 1
        assert store.stats().tiers[tiers.SSD].entries == 1


def test_put_refuses_unstorable_input(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        with pytest.raises(ValueError):
            store.put(KEYS[0], make_kv(dtype=torch.float64))
        with pytest.raises(ValueError):
            store.put(KEYS[0], make_kv(num_tokens=0))
        with pytest.raises(ValueError):
            store.put("not/a/key", make_kv())
        assert store.lookup([KEYS[0]]) == [None]


def test_config_rejects_negative_budgets() -> None:
    with pytest.raises(ValueError):
        KVStoreConfig(model_fingerprint=FINGERPRINT, memory_budget_bytes=-1)


@pytest.mark.timeout(60)
def test_concurrent_puts_gets_and_streams_stay_exact(tmp_path: Path) -> None:
    expected = {key: make_kv(seed=i, num_tokens=1 + i % 4) for i, key in enumerate(KEYS)}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for step in range(60):
                key = KEYS[(offset * 7 + step) % len(KEYS)]
                store.put(key, expected[key])
                got = read_entry(store, KEYS[(offset + step * 3) % len(KEYS)])
                if got is not None:
                    assert any(torch.equal(got.keys, kv.keys) for kv in expected.values())
                wanted = KEYS[step % 5 : step % 5 + 3]
                with store.open_stream(wanted) as stream:
                    found = [w for w, p in zip(wanted, stream.present, strict=True) if p]
                    for i in range(4):
                        for (k, _), key_j in zip(stream.layer(i), found, strict=True):
                            assert torch.equal(k, expected[key_j].keys[i])
        except BaseException as exc:  # surfaced below; a thread's failure is otherwise lost
            errors.append(exc)

    with KVStore(_config(tmp_path, memory_entries=10)) as store:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        store.flush()
        assert store.check(verify_data=True).removed_corrupt == 0
        assert store.stats().write_errors == 0
        for key in store.tier(tiers.SSD).keys_lru_first():
            store.tier(tiers.MEMORY).discard(key)
            got = read_entry(store, key)
            assert isinstance(got, ChunkKV)
            assert_kv_equal(got, expected[key])


def test_put_after_close_is_refused(tmp_path: Path) -> None:
    store = KVStore(_config(tmp_path))
    store.close()
    store.close()  # idempotent
    store.flush()  # nothing pending, returns at once
    with pytest.raises(RuntimeError):
        store.put(KEYS[0], make_kv())


def test_tiers_are_walked_fastest_first_and_named_once(tmp_path: Path) -> None:
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT, ssd_path=tmp_path / "kv", gpu_budget_bytes=1 << 20
    )
    with KVStore(config) as store:
        assert [t.name for t in store.tiers] == [tiers.GPU, tiers.MEMORY, tiers.SSD]
        assert list(store.stats().tiers) == [tiers.GPU, tiers.MEMORY, tiers.SSD]
        store.put(KEYS[0], make_kv())
        store.flush()
        assert store.lookup([KEYS[0], KEYS[1]]) == [tiers.MEMORY, None]  # puts go to host memory


def test_an_entry_hit_repeatedly_in_host_memory_is_promoted_to_the_gpu_tier() -> None:
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT, gpu_budget_bytes=1 << 20, gpu_promote_hits=2
    )
    kv = make_kv(seed=4)
    with KVStore(config) as store:
        store.put(KEYS[0], kv)
        for expected in (tiers.MEMORY, tiers.MEMORY, tiers.GPU):
            with store.open_stream([KEYS[0]]) as stream:
                assert stream.tiers == [expected]
                for i in range(kv.num_layers):
                    stream.layer(i)
            store.flush()
        assert store.lookup([KEYS[0]]) == [tiers.GPU]
        assert_kv_equal(store.tier(tiers.GPU).get(KEYS[0]), kv)


def _gpu_config(
    memory_entries: int, gpu_promote_hits: int, memory_policy: PolicyName = "tinylfu"
) -> KVStoreConfig:
    """A gpu tier on the CPU: the promotion bookkeeping of CUDA, testable here."""
    return KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=memory_entries * make_kv().nbytes,
        gpu_budget_bytes=1 << 20,
        gpu_promote_hits=gpu_promote_hits,
        memory_policy=memory_policy,
    )


def test_a_hit_before_an_entry_left_host_memory_does_not_count_towards_the_gpu() -> None:
    # lru: the second put must evict KEYS[0] from host memory, whatever its hit.
    with KVStore(_gpu_config(memory_entries=1, gpu_promote_hits=2, memory_policy="lru")) as store:
        store.put(KEYS[0], make_kv(seed=0))
        read_entry(store, KEYS[0])  # one hit
        store.put(KEYS[1], make_kv(seed=1))  # evicts KEYS[0] from host memory
        store.put(KEYS[0], make_kv(seed=0))  # back, counted from 0 again
        read_entry(store, KEYS[0])
        store.flush()
        assert store.lookup([KEYS[0]]) == [tiers.MEMORY]
        read_entry(store, KEYS[0])  # its second hit since it came back
        store.flush()
        assert store.lookup([KEYS[0]]) == [tiers.GPU]


def test_host_hit_counters_never_outgrow_host_memory_or_their_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with KVStore(_gpu_config(memory_entries=3, gpu_promote_hits=5)) as store:
        for i, key in enumerate(KEYS[:20]):  # each hit once, then evicted by the next ones
            store.put(key, make_kv(seed=i))
            read_entry(store, key)
        assert len(store._host_hits) == 3  # the three entries host memory holds
    monkeypatch.setattr(kvstore_store, "HOST_HITS_MAX_KEYS", 4)
    with KVStore(_gpu_config(memory_entries=20, gpu_promote_hits=5)) as store:
        for i, key in enumerate(KEYS[:20]):  # all held in host memory, each hit once
            store.put(key, make_kv(seed=i))
            read_entry(store, key)
        assert list(store._host_hits) == KEYS[16:20]  # the most recently hit


def test_a_gpu_tier_hit_is_served_without_a_copy() -> None:
    config = KVStoreConfig(model_fingerprint=FINGERPRINT, gpu_budget_bytes=1 << 20)
    kv = make_kv(seed=6)
    with KVStore(config) as store:
        assert store.put_local(KEYS[0], kv)
        held = store.tier(tiers.GPU).get(KEYS[0])
        with store.open_stream([KEYS[0]]) as stream:
            k, _ = stream.layer(0)[0]
        assert k.data_ptr() == held.keys[0].data_ptr()
        assert stream.stats.device_copies == 0


def test_keys_are_validated_before_anything_is_stored(tmp_path: Path) -> None:
    with KVStore(KVStoreConfig(model_fingerprint=FINGERPRINT)) as store:
        for bad in ("a/../b", "", "x", "k" * 201):
            with pytest.raises(ValueError):
                store.put(bad, make_kv())
        assert store.stats().tiers[tiers.MEMORY].entries == 0
