"""The remote tier on a real redis-server: exact round trips in every encoding, bad or evicted
values as misses, and a Redis that is down, hung or back again never failing the store."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvstore import codec, tiers
from kvstore.errors import KVStreamError
from kvstore.remote_tier import RemoteTier, check_url, redact_url
from kvstore.ssd_tier import SSDTier
from kvstore.store import KVStore, KVStoreConfig
from tests.kvstore.kv_testutil import (
    FINGERPRINT,
    assert_kv_equal,
    key_of,
    make_kv,
    read_entry,
    read_header,
)
from tests.redis_server import RedisServer

KEYS = [key_of(i) for i in range(40)]
MB = 1 << 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    started = RedisServer(tmp_path / "redis").start()
    yield started
    started.stop()


def _store(url: str, tmp_path: Path | None = None, encoding: str = "none") -> KVStore:
    """A store with an empty host memory (and SSD under `tmp_path`) and the remote tier."""
    return KVStore(
        KVStoreConfig(
            model_fingerprint=FINGERPRINT,
            memory_budget_bytes=1 << 26,
            ssd_path=None if tmp_path is None else tmp_path / "kv",
            ssd_budget_bytes=1 << 30,
            persistent_encoding=encoding,
            remote_url=url,
        )
    )


def _raw(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
def test_put_then_read_is_exact_in_each_encoding(server: RedisServer, encoding, dtype) -> None:
    kv = make_kv(seed=3, dtype=dtype)
    tier = RemoteTier(server.url, FINGERPRINT, encoding)
    assert KEYS[0] not in tier
    tier.put(KEYS[0], kv)
    assert KEYS[0] in tier
    other_model = RemoteTier(server.url, "another-model/v1", encoding)
    assert KEYS[0] not in other_model and other_model.open(KEYS[0]) is None

    got = RemoteTier(server.url, FINGERPRINT).get(KEYS[0])  # reads whatever encoding was written
    assert got is not None
    assert_kv_equal(got, codec.round_trip(kv, encoding))
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.bytes_written > 0) == (None, None, True)
    assert stats.reachable and stats.last_error is None


def test_a_store_reads_remote_entries_layer_by_layer_and_promotes_them(
    server: RedisServer, tmp_path: Path
) -> None:
    kv = make_kv(seed=5)
    with _store(server.url) as writer:
        assert writer.put(KEYS[0], kv).result(timeout=10) is True  # no SSD: in Redis
        assert [t.name for t in writer.tiers] == [tiers.MEMORY, tiers.REMOTE]
    with _store(server.url, tmp_path) as reader:
        assert reader.lookup([KEYS[0], KEYS[1]]) == [tiers.REMOTE, None]
        with reader.open_stream([KEYS[0]], first_layer=2) as stream:
            assert stream.tiers == [tiers.REMOTE]
            layers = [stream.layer(i)[0] for i in (2, 3)]
        for (k, v), i in zip(layers, (2, 3), strict=True):
            assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
        reader.flush()  # the worker read layers 0 and 1 and promoted the whole entry
        assert reader.lookup([KEYS[0]]) == [tiers.MEMORY]
        assert KEYS[0] in reader.tier(tiers.SSD)  # type: ignore[operator]
        assert_kv_equal(read_entry(reader, KEYS[0]), kv)
        assert reader.stats().tiers[tiers.REMOTE].hits == 1


def _assert_ssd_file_holds_the_remote_values(store: KVStore, server: RedisServer, key: str):
    ssd = store.tier(tiers.SSD)
    assert isinstance(ssd, SSDTier)
    data = ssd.file_path(key).read_bytes()
    values = _raw(server).hgetall(RemoteTier(server.url, FINGERPRINT).redis_key(key))
    header = read_header(ssd.file_path(key), key)
    assert data[: header.data_offset] == values[b"h"]
    for i in range(header.num_layers):
        at = header.layer_offset(i)
        assert data[at : at + len(values[str(i).encode()])] == values[str(i).encode()]
    return header


def test_a_put_writes_one_encoding_of_the_entry_to_ssd_and_remote(
    server: RedisServer, tmp_path: Path
) -> None:
    with _store(server.url, tmp_path, encoding="int8") as store:
        assert store.put(KEYS[0], make_kv(seed=6)).result(timeout=10) is True
        header = _assert_ssd_file_holds_the_remote_values(store, server, KEYS[0])
    assert header.encoding == "int8"


def test_a_remote_entry_promoted_to_ssd_is_written_as_stored_not_encoded_again(
    server: RedisServer, tmp_path: Path
) -> None:
    kv = make_kv(seed=7)
    with _store(server.url, encoding="int8") as writer:
        writer.put(KEYS[0], kv).result(timeout=10)
    with _store(server.url, tmp_path, encoding="none") as reader:
        with reader.open_stream([KEYS[0]]) as stream:
            for i in range(kv.num_layers):
                stream.layer(i)
        reader.flush()
        header = _assert_ssd_file_holds_the_remote_values(reader, server, KEYS[0])
        assert_kv_equal(read_entry(reader, KEYS[0]), codec.round_trip(kv, "int8"))
    assert header.encoding == "int8"  # the reader's own encoding ("none") was not applied


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_bad_layer_value_is_a_miss_counted_and_deleted(server: RedisServer, damage) -> None:
    with _store(server.url, encoding="int8") as writer:
        writer.put(KEYS[0], make_kv()).result(timeout=10)
    tier = RemoteTier(server.url, FINGERPRINT)
    raw, name = _raw(server), tier.redis_key(KEYS[0])
    value = bytearray(raw.hget(name, "2"))
    if damage == "flipped":
        value[7] ^= 0xFF
    else:
        value = value[:-5]
    raw.hset(name, "2", bytes(value))

    with _store(server.url) as reader:
        with reader.open_stream([KEYS[0]]) as stream:
            assert stream.present == [True]
            stream.layer(0), stream.layer(1)
            with pytest.raises(KVStreamError) as failed:
                stream.layer(2)
        assert failed.value.key == KEYS[0]
        assert reader.stats().tiers[tiers.REMOTE].corrupt == 1
        assert raw.exists(name) == 0  # deleted: the next engine recomputes and rewrites it
        assert reader.lookup([KEYS[0]]) == [None]


def test_a_bad_header_is_a_miss_counted_and_deleted(server: RedisServer) -> None:
    tier = RemoteTier(server.url, FINGERPRINT)
    tier.put(KEYS[0], make_kv())
    raw, name = _raw(server), tier.redis_key(KEYS[0])
    raw.hset(name, "h", raw.hget(name, "h")[:-1])
    assert tier.open(KEYS[0]) is None
    assert (tier.stats().corrupt, tier.stats().misses, raw.exists(name)) == (1, 1, 0)


def test_an_entry_evicted_while_streaming_is_a_miss_not_corrupt(server: RedisServer) -> None:
    tier = RemoteTier(server.url, FINGERPRINT)
    tier.put(KEYS[0], make_kv())
    with _store(server.url) as reader:
        with reader.open_stream([KEYS[0]], lookahead=0) as stream:
            stream.layer(0)
            _raw(server).delete(tier.redis_key(KEYS[0]))  # what allkeys-lru does to a hash
            with pytest.raises(KVStreamError):
                stream.layer(1)
        stats = reader.stats().tiers[tiers.REMOTE]
        assert (stats.hits, stats.misses, stats.corrupt) == (1, 1, 0)


def test_redis_evicting_under_maxmemory_gives_misses_never_errors(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", maxmemory="2mb").start()
    try:
        entries = [make_kv(seed=i, num_tokens=100, head_dim=64) for i in range(12)]  # 400 KB
        with _store(server.url) as store:
            for key, kv in zip(KEYS, entries, strict=False):
                store.put(key, kv).result(timeout=10)
            assert store.stats().write_errors == 0
        with _store(server.url) as reader:
            found = reader.lookup(KEYS[:12])
            assert found[-1] == tiers.REMOTE and found.count(None) >= 6  # evicted, oldest first
            for key, kv in zip(KEYS, entries, strict=False):
                try:
                    entry = read_entry(reader, key)
                except KVStreamError:  # evicted while read (a reply's buffer counts as memory)
                    continue
                if entry is not None:
                    assert_kv_equal(entry, kv)
            assert reader.stats().tiers[tiers.REMOTE].corrupt == 0
    finally:
        server.stop()


def test_redis_down_is_a_quick_miss_and_a_counted_write_failure(
    server: RedisServer, tmp_path: Path
) -> None:
    with _store(server.url, tmp_path) as store:
        store.put(KEYS[0], make_kv(seed=0)).result(timeout=10)
        server.stop(signal.SIGKILL)
        start = time.monotonic()
        with _store(server.url) as cold:  # a second engine, nothing local
            assert cold.lookup([KEYS[0]]) == [None]
            assert read_entry(cold, KEYS[0]) is None
            remote = cold.stats().tiers[tiers.REMOTE]
            assert not remote.reachable and "ConnectionError" in (remote.last_error or "")
        assert time.monotonic() - start < 5

        written = store.put(KEYS[1], make_kv(seed=1))
        assert written.result(timeout=10) is True  # on SSD; only the remote write failed
        stats = store.stats()
        assert stats.write_errors_by_tier == {tiers.SSD: 0, tiers.REMOTE: 1}
        # Unreachable is the tier's state (with its last error), not a failing write.
        assert stats.last_write_error_by_tier == {tiers.SSD: None, tiers.REMOTE: None}
        assert not stats.tiers[tiers.REMOTE].reachable
        assert_kv_equal(read_entry(store, KEYS[1]), make_kv(seed=1))


def test_redis_back_is_used_again_after_the_backoff(server: RedisServer, tmp_path: Path) -> None:
    with _store(server.url, tmp_path) as store:
        server.stop(signal.SIGKILL)
        assert store.put(KEYS[0], make_kv(seed=0)).result(timeout=10) is True
        assert store.stats().write_errors_by_tier[tiers.REMOTE] == 1
        server.start()
        assert store.lookup([KEYS[5]]) == [None]  # backing off: Redis is not asked yet
        time.sleep(1.2)  # the first back-off is 1 s
        store.put(KEYS[1], make_kv(seed=1)).result(timeout=10)
        stats = store.stats()
        assert stats.tiers[tiers.REMOTE].reachable
        assert stats.last_write_error_by_tier[tiers.REMOTE] is None
        assert KEYS[1] in RemoteTier(server.url, FINGERPRINT)


def test_a_write_redis_refuses_is_a_failing_write_until_one_succeeds(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", policy="noeviction").start()
    try:
        server.limit_memory(headroom_bytes=2 * MB)  # above the empty server's own use
        with _store(server.url) as store:
            big = make_kv(num_tokens=1000, head_dim=64)  # 4 MB in layers of 1 MB
            assert store.put(KEYS[0], big).result(timeout=10) is False
            stats = store.stats()
            assert stats.tiers[tiers.REMOTE].reachable  # Redis answered: OOM
            assert "OutOfMemoryError" in (stats.last_write_error_by_tier[tiers.REMOTE] or "")
            # Redis 7 keeps a query buffer as large as the refused value on the connection, in
            # used_memory, until its client cron trims it (0.1-0.2 s): it may refuse again.
            deadline = time.monotonic() + 5
            while not store.put(KEYS[1], make_kv()).result(timeout=10):
                assert time.monotonic() < deadline, store.stats().last_write_error_by_tier
                time.sleep(0.05)
            assert store.stats().last_write_error_by_tier[tiers.REMOTE] is None
            assert KEYS[1] in RemoteTier(server.url, FINGERPRINT)
    finally:
        server.stop()


def test_a_hung_redis_times_out_into_misses(server: RedisServer, tmp_path: Path) -> None:
    tier = RemoteTier(server.url, FINGERPRINT)
    tier.put(KEYS[0], make_kv())
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        with _store(server.url, tmp_path) as store:
            start = time.monotonic()
            assert store.lookup([KEYS[0]]) == [None]
            assert read_entry(store, KEYS[0]) is None
            assert time.monotonic() - start < 3  # one 0.5 s timeout, then the breaker
            assert not store.stats().tiers[tiers.REMOTE].reachable
            assert "Timeout" in (store.stats().tiers[tiers.REMOTE].last_error or "")
    finally:
        server.proc.send_signal(signal.SIGCONT)


def test_redis_urls_are_checked_and_passwords_kept_out_of_messages() -> None:
    assert check_url("rediss://u:pw@cache:6380/2") == "rediss://u:pw@cache:6380/2"
    assert redact_url("redis://u:s3cret@cache:6379/0") == "redis://u:***@cache:6379/0"
    assert redact_url("redis://:s3cret@cache/0") == "redis://:***@cache/0"
    for bad in ("http://cache:6379", "redis://", "cache:6379", "redis://:s3cret@cache:99999/0"):
        with pytest.raises(ValueError) as refused:
            check_url(bad)
        assert "s3cret" not in str(refused.value)
