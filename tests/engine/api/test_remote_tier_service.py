"""Engine processes sharing a real redis-server: a fresh engine answers from KV another engine
precomputed, a bad Redis value is recomputed, and Redis down or back never fails a request."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from engine.engine import Engine
from engine.types import Chunk, GenerateRequest
from tests.engine.api.test_service import metric_value
from tests.redis_server import RedisServer
from tests.service_process import Service, service_env, start_service

SHARED = [
    {"id": "a", "text": "kalo vo zuren holds the tas of pe."},
    {"id": "b", "text": "the dri of sol is quber, near the nor."},
    {"id": "c", "text": "gimhu wen ylos trevo anka."},
]
QUESTION = "what does kalo hold?"
RECOVERY_TIMEOUT_S = 60.0  # the back-off doubles while Redis is down (1, 2, 4 ... s)


@dataclass
class Cluster:
    redis: RedisServer  # not running until a test starts it
    first: Service
    second: Service


def _engine(model: str, tmp: Path, name: str, url: str) -> Service:
    # kv-encoding none: KV read from Redis is the bytes computed, so answers compare exactly.
    return start_service(
        "engine",
        ["--model", model, "--store-path", str(tmp / name / "kv"), "--kv-encoding", "none"],
        tmp / f"{name}.log",
        env={"RAGBLEND_ENGINE_REMOTE_URL": url},
    )


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory) -> Iterator[Cluster]:
    """Two engines on one Redis, started while Redis is not running yet."""
    tmp = tmp_path_factory.mktemp("remote-service")
    server = RedisServer(tmp / "redis")
    first = _engine(tiny_model, tmp, "first", server.url)
    second = _engine(tiny_model, tmp, "second", server.url)
    yield Cluster(server, first, second)
    for engine in (first, second):
        assert engine.stop() in (0, -signal.SIGTERM), engine.log()[-3000:]
    server.stop()


def _remote(client: httpx.Client) -> dict:
    return client.get("/health").json()["store"]["remote"]


def _wait_remote_ok(*engines: Service) -> None:
    """Until every engine's /health says its remote tier is ok again (health pings Redis)."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    for engine in engines:
        with engine.client() as client:
            while _remote(client)["state"] != "ok":
                assert time.monotonic() < deadline, engine.log()[-3000:]
                time.sleep(0.3)


@pytest.fixture
def redis_up(cluster: Cluster) -> Cluster:
    if cluster.redis.proc is None:
        cluster.redis.start()
    _wait_remote_ok(cluster.first, cluster.second)
    return cluster


def _ask(client: httpx.Client, chunks: list[dict], **overrides) -> dict:
    body = {"chunks": chunks, "question": QUESTION, "max_tokens": 8, "recompute_ratio": 0.3}
    reply = client.post("/v1/generate", json={**body, **overrides})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _chunks(tag: str, count: int = 2) -> list[dict]:
    words = ["zuren", "quber", "anka", "trevo", "ylos", "gimhu", "sol", "nor"]
    return [
        {"id": f"{tag}{i}", "text": f"{tag} {' '.join(words[i:] + words[:i])} {tag}."}
        for i in range(count)
    ]


def _kv_keys(server: RedisServer) -> set[bytes]:
    return set(redis.Redis.from_url(server.url).scan_iter(match="ragblend:kv:*"))


def test_an_engine_started_while_redis_was_down_reports_it_and_recovers(cluster: Cluster) -> None:
    with cluster.first.client() as client:
        health = client.get("/health").json()
        assert health["shared_kv"] is True
        remote = health["store"]["remote"]
        assert set(remote) == {"entries", "bytes", "state", "last_error", "hits", "misses"}
        assert remote["entries"] is None and remote["bytes"] is None
        if cluster.redis.proc is None:  # this test ran first: Redis is still down
            assert remote["state"] == "unreachable" and "Connection" in remote["last_error"]
            assert metric_value(client, "ragblend_engine_remote_up") == 0
            for engine in (cluster.first, cluster.second):  # both alike for the next tests
                with engine.client() as each:
                    assert _ask(each, _chunks("down"))["chunk_tiers"] == [None, None]
            cluster.redis.start()
    _wait_remote_ok(cluster.first, cluster.second)
    with cluster.first.client() as client:
        assert metric_value(client, "ragblend_engine_remote_up") == 1
        assert _remote(client)["last_error"] is None


def test_a_fresh_engine_answers_from_kv_another_engine_precomputed(redis_up: Cluster) -> None:
    with redis_up.first.client() as first:
        stored = first.post("/v1/precompute", json={"chunks": SHARED}).json()
        assert stored["stored"] == 3, stored  # on its SSD and, once answered, in Redis
        expected = _ask(first, SHARED)
    with redis_up.second.client() as second:
        again = second.post("/v1/precompute", json={"chunks": SHARED}).json()
        assert again["skipped"] == 3  # found in Redis: a cluster precomputes a chunk once
        hits_before = _remote(second)["hits"]
        result = _ask(second, SHARED)
        assert result["chunk_tiers"] == ["remote"] * 3
        assert result["usage"]["cached_tokens"] > 0
        assert result["usage"]["cached_tokens"] == expected["usage"]["cached_tokens"]
        assert result["text"] == expected["text"]
        assert _remote(second)["hits"] == hits_before + 3
        hits = metric_value(second, "ragblend_engine_kv_lookups_total", tier="remote", result="hit")
        assert hits >= 3
        assert metric_value(second, "ragblend_engine_kv_load_bytes_total", tier="remote") > 0
        assert metric_value(second, "ragblend_engine_remote_seconds_count", op="get") > 0
        deadline = time.monotonic() + 20  # the promotion runs in the background
        while _ask(second, SHARED)["chunk_tiers"] != ["memory"] * 3:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_a_corrupted_redis_value_is_recomputed_and_the_answer_is_unchanged(
    redis_up: Cluster, tiny_model
) -> None:
    bad, good = _chunks("corrupt")
    before = _kv_keys(redis_up.redis)
    with redis_up.first.client() as first:
        assert first.post("/v1/precompute", json={"chunks": [bad]}).json()["stored"] == 1
        (bad_key,) = _kv_keys(redis_up.redis) - before
        assert first.post("/v1/precompute", json={"chunks": [good]}).json()["stored"] == 1
    raw = redis.Redis.from_url(redis_up.redis.url)
    value = bytearray(raw.hget(bad_key, "2"))
    value[3] ^= 0xFF
    raw.hset(bad_key, "2", bytes(value))

    # The answer when the bad chunk has no KV at all and the good one is cached.
    engine = Engine.from_pretrained(tiny_model)
    engine.precompute([Chunk(good["id"], good["text"])])
    expected = engine.generate(
        GenerateRequest(
            question=QUESTION,
            chunks=(Chunk(bad["id"], bad["text"]), Chunk(good["id"], good["text"])),
            max_tokens=8,
            recompute_ratio=0.3,
        )
    )
    engine.close()

    with redis_up.second.client() as second:
        result = _ask(second, [bad, good])
        assert result["text"] == expected.text
        assert result["chunk_tiers"] == [None, "remote"]  # the bad one dropped mid-stream
        assert result["usage"]["cached_tokens"] > 0
        assert "recomputing after a KV stream error" in redis_up.second.log()
        assert metric_value(second, "ragblend_engine_store_corrupt_entries", tier="remote") == 1
    assert raw.hget(bad_key, "2") != bytes(value)  # deleted (or rewritten by the write-back)


def test_requests_succeed_while_redis_is_down_and_it_is_used_again_when_back(
    redis_up: Cluster,
) -> None:
    before_kill = _chunks("kill")
    with redis_up.first.client() as first:
        first.post("/v1/precompute", json={"chunks": before_kill}).raise_for_status()
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:  # requests in flight while Redis dies
        with redis_up.second.client() as client:
            i = 0
            while not stop.is_set():
                # New chunks every time: each one is looked up in Redis, then written back.
                body = {"chunks": _chunks(f"load{i}"), "question": QUESTION, "max_tokens": 4}
                statuses.append(client.post("/v1/generate", json=body).status_code)
                i += 1

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(1.0)
        redis_up.redis.stop(signal.SIGKILL)
        time.sleep(1.0)
    finally:
        stop.set()
        loader.join()
    assert len(statuses) >= 2 and set(statuses) == {200}
    with redis_up.second.client() as second:
        # In Redis before it died, on no local tier here: recomputed.
        assert _ask(second, before_kill)["chunk_tiers"] == [None, None]
        assert _remote(second)["state"] == "unreachable"
        assert metric_value(second, "ragblend_engine_remote_up") == 0
    with redis_up.first.client() as first:
        stored = first.post("/v1/precompute", json={"chunks": _chunks("while-down")}).json()
        assert stored["stored"] == 2  # on its SSD; the Redis write failed and was counted
        assert metric_value(first, "ragblend_engine_kv_write_failures_total", tier="remote") >= 1

    redis_up.redis.start()  # empty: nothing was persisted
    _wait_remote_ok(redis_up.first, redis_up.second)
    after = _chunks("back")
    with redis_up.first.client() as first:
        assert first.post("/v1/precompute", json={"chunks": after}).json()["stored"] == 2
    with redis_up.second.client() as second:
        hits_before = _remote(second)["hits"]
        assert _ask(second, after)["chunk_tiers"] == ["remote", "remote"]
        assert _remote(second)["hits"] == hits_before + 2
        assert metric_value(second, "ragblend_engine_remote_up") == 1


def test_a_bad_remote_url_is_a_startup_error_naming_the_setting(tiny_model) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ragblend", "engine", "--model", tiny_model],
        env=service_env(RAGBLEND_ENGINE_REMOTE_URL="http://user:s3cret@cache:6379/0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "remote_url" in done.stderr and "not a Redis URL" in done.stderr
    assert "s3cret" not in done.stderr + done.stdout
