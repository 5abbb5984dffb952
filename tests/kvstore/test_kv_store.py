"""The KVStore facade: tiers by lookup, exact round trips, promotion, restart, background
write-through (including a failed write), check(), and concurrent use from several threads."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from kvstore.store import KVStore, KVStoreConfig
from kvstore.types import ChunkKV
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, key_of, make_kv, read_entry

KEYS = [key_of(i) for i in range(40)]


def _config(tmp_path: Path | None, memory_entries: int = 100) -> KVStoreConfig:
    return KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=memory_entries * make_kv().nbytes,
        ssd_path=None if tmp_path is None else tmp_path / "kv",
        ssd_budget_bytes=1 << 30,
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
    with KVStore(_config(tmp_path, memory_entries=2)) as store:
        for i in range(3):
            store.put(KEYS[i], make_kv(seed=i))
        store.flush()
        assert store.lookup(KEYS[:3]) == ["ssd", "memory", "memory"]
        assert_kv_equal(read_entry(store, KEYS[0]), make_kv(seed=0))
        store.flush()
        assert store.lookup(KEYS[:3]) == ["memory", "ssd", "memory"]


def test_memory_only_store_works_without_ssd() -> None:
    with KVStore(_config(None)) as store:
        store.put(KEYS[0], make_kv())
        store.flush()
        assert store.lookup([KEYS[0], KEYS[1]]) == ["memory", None]
        assert read_entry(store, KEYS[1]) is None
        assert store.stats().ssd is None


def test_failed_ssd_write_is_counted_and_entry_stays_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KVStore(_config(tmp_path)) as store:

        def disk_full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        store.put(KEYS[0], make_kv())
        store.flush()
        monkeypatch.undo()
        stats = store.stats()
        assert (stats.write_errors, stats.pending_writes, stats.ssd.entries) == (1, 0, 0)
        assert store.lookup([KEYS[0]]) == ["memory"]
        assert list((tmp_path / "kv").glob("*/*")) == []


def test_bad_ssd_entry_is_a_miss_through_the_store(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        store.put(KEYS[0], make_kv())
        store.flush()
        store.memory.discard(KEYS[0])
        path = store.ssd.file_path(KEYS[0])
        os.truncate(path, 100)
        assert read_entry(store, KEYS[0]) is None
        assert store.lookup([KEYS[0]]) == [None] and not path.exists()
        stats = store.stats()
        assert (stats.ssd.corrupt, stats.ssd.misses, stats.memory.misses) == (1, 1, 1)


def test_check_reports_file_deleted_behind_the_index(tmp_path: Path) -> None:
    with KVStore(_config(tmp_path)) as store:
        store.put(KEYS[0], make_kv())
        store.put(KEYS[1], make_kv(seed=1))
        store.flush()
        store.ssd.file_path(KEYS[0]).unlink()
        report = store.check()
        assert report.dropped_missing == 1
        assert store.stats().ssd.entries == 1


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
        for key in store.ssd.keys_lru_first():
            store.memory.discard(key)
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
