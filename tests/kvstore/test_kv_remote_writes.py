"""Remote-tier writes on a real redis-server: an entry is written whole or not at all, a header
left without its layers is a miss that heals, two writers never leave a mixed entry, and a read
racing them never combines two writes nor deletes the entry."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvstore import codec, tiers
from kvstore.errors import KVStreamError
from kvstore.remote_tier import RemoteTier, RemoteTierError
from kvstore.store import KVStore, KVStoreConfig
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, key_of, make_kv, read_entry
from tests.redis_server import RedisServer, redis_server

KEYS = [key_of(i) for i in range(40)]
MB = 1 << 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as started:
        yield started


def _remote_store(url: str) -> KVStore:
    """A store of host memory and the remote tier (no SSD), so writes go to Redis."""
    return KVStore(KVStoreConfig(model_fingerprint=FINGERPRINT, remote_url=url))


def test_a_write_redis_refuses_half_way_leaves_nothing_in_redis(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis", policy="noeviction") as server:
        server.limit_memory(headroom_bytes=4 * MB)  # room for three or four of six layers
        tier = RemoteTier(server.url, FINGERPRINT)
        big = make_kv(num_layers=6, num_tokens=1000, head_dim=64)  # 6 layers of 1 MB
        with pytest.raises(RemoteTierError) as refused:
            tier.put(KEYS[0], big)
        assert refused.value.answered and "OutOfMemoryError" in str(refused.value)
        with redis.Redis.from_url(server.url) as raw:
            assert raw.dbsize() == 0  # no layer left behind, invisible and never evicted
        assert KEYS[0] not in tier


def test_a_header_without_its_layers_is_a_miss_that_heals(server: RedisServer) -> None:
    kv = make_kv(seed=4)
    tier = RemoteTier(server.url, FINGERPRINT)
    tier.put(KEYS[0], kv)
    name = tier.redis_key(KEYS[0])
    with redis.Redis.from_url(server.url) as raw:
        raw.hdel(name, "1", "2")  # what an earlier, non-atomic write could leave behind
        with _remote_store(server.url) as store:
            assert store.lookup([KEYS[0]]) == [tiers.REMOTE]
            with pytest.raises(KVStreamError):
                read_entry(store, KEYS[0])
            store.flush()
            assert raw.exists(name) == 0  # deleted by the failed read: no longer a hit
            assert store.lookup([KEYS[0]]) == [None]
            stats = store.stats().tiers[tiers.REMOTE]
            assert (stats.hits, stats.misses) == (1, 1)

            assert store.put(KEYS[0], kv).result(timeout=10) is True  # written again
    got = RemoteTier(server.url, FINGERPRINT).get(KEYS[0])
    assert got is not None
    assert_kv_equal(got, kv)


def test_two_writers_of_one_key_in_two_encodings_never_leave_a_mixed_entry(
    server: RedisServer,
) -> None:
    kv = make_kv(seed=6, num_layers=8, num_tokens=64, head_dim=32)
    encodings = ("none", "int8")
    writers = [RemoteTier(server.url, FINGERPRINT, encoding) for encoding in encodings]
    expected = [codec.round_trip(kv, encoding) for encoding in encodings]
    reader = RemoteTier(server.url, FINGERPRINT)
    for key in KEYS[:30]:
        start = threading.Barrier(len(writers))

        def write(writer: RemoteTier, key: str = key, start: threading.Barrier = start) -> None:
            start.wait()
            writer.put(key, kv)

        threads = [threading.Thread(target=write, args=(w,)) for w in writers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        got = reader.get(key)
        assert got is not None, f"{key}: header and layers of different writes"
        assert any(
            torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
            for want in expected
        )
    assert reader.stats().corrupt == 0


def test_reads_racing_two_writers_in_two_encodings_never_mix_them_nor_delete_the_entry(
    server: RedisServer,
) -> None:
    kv = make_kv(seed=7, num_layers=8, num_tokens=64, head_dim=32)
    encodings = ("none", "int8")  # a layer of each has another length
    writers = [RemoteTier(server.url, FINGERPRINT, encoding) for encoding in encodings]
    expected = [codec.round_trip(kv, encoding) for encoding in encodings]
    writers[0].put(KEYS[0], kv)
    reader = RemoteTier(server.url, FINGERPRINT)
    stop = threading.Event()

    def rewrite(writer: RemoteTier) -> None:
        while not stop.is_set():
            writer.put(KEYS[0], kv)
            time.sleep(0.002)  # room for some reads to complete between the writes

    threads = [threading.Thread(target=rewrite, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()

    def one_of_the_writes(got) -> bool:
        return any(
            torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
            for want in expected
        )

    try:
        for _ in range(300):
            got = reader.get(KEYS[0])  # header, then each layer: writes land in between
            assert got is None or one_of_the_writes(got), "a read combined two writes"
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    stats = reader.stats()
    assert stats.misses > 0  # reads met rewrites
    assert stats.corrupt == 0  # a rewrite is a miss, not a bad entry
    got = reader.get(KEYS[0])  # never deleted: the last write reads back whole
    assert got is not None and one_of_the_writes(got)
