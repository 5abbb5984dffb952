"""The Redis lookups of a prompt, and of a precompute, are one pipelined round trip on the
caller's thread, never on the engine's; a queued request's stream loads nothing until its
prefill starts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.model.load import load_model
from engine.types import GenerateRequest
from kvstore import tiers
from kvstore.remote_tier import RemoteTier
from kvstore.store import KVStore, KVStoreConfig
from tests.redis_server import RedisServer, redis_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as started:
        yield started


@pytest.fixture
def engine(server: RedisServer, checkpoint_dir) -> Iterator[Engine]:
    """Chunk KV in Redis only: no host memory tier to hit, no SSD."""
    loaded = load_model(checkpoint_dir("llama"))
    config = KVStoreConfig(
        model_fingerprint=loaded.fingerprint, memory_budget_bytes=0, remote_url=server.url
    )
    with KVStore(config) as store:
        engine = Engine(loaded, store)
        yield engine
        engine.close()


def _record_ops(engine: Engine) -> list[tuple[str, str]]:
    """Every Redis operation from now on: (op, the thread that ran it)."""
    ops: list[tuple[str, str]] = []
    remote = engine.store.tier(tiers.REMOTE)
    assert isinstance(remote, RemoteTier)
    remote.add_latency_listener(lambda op, _: ops.append((op, threading.current_thread().name)))
    return ops


def test_a_served_prompt_looks_its_chunks_up_in_one_round_trip_off_the_engine_thread(
    engine: Engine, make_chunks
):
    chunks = make_chunks(6, seed=81)
    engine.precompute(chunks)
    engine.store.flush()  # the writes to Redis
    ops = _record_ops(engine)
    result = engine.generate(GenerateRequest(question="who is zuka?", chunks=chunks, max_tokens=2))
    assert result.chunk_tiers == [tiers.REMOTE] * 6
    lookups = [thread for op, thread in ops if op == "lookup"]
    assert lookups == [threading.current_thread().name]  # one, on the caller's thread
    assert all(thread != engine.worker._thread.name for _, thread in ops)


def test_a_precompute_asks_redis_once_for_every_chunk_and_skips_those_it_has(
    engine: Engine, make_chunks
):
    chunks = make_chunks(5, seed=82)
    engine.precompute(chunks[:3])
    engine.store.flush()
    ops = _record_ops(engine)
    result = engine.precompute(chunks)
    assert (result.skipped, result.stored) == (3, 2)
    here = threading.current_thread().name
    assert [op for op, thread in ops if thread == here] == ["lookup"]  # one, for all five
    assert all(thread != engine.worker._thread.name for _, thread in ops)


def test_a_queued_requests_stream_loads_nothing_until_its_prefill_starts(
    engine: Engine, make_chunks
):
    chunks = make_chunks(3, seed=83)
    engine.precompute(chunks)
    engine.store.flush()
    request = GenerateRequest(question="who is zuka?", chunks=chunks)
    opened = engine.open_kv(request, engine.layout(request))
    assert opened is not None
    try:
        threading.Event().wait(0.3)  # the loader is idle: it would have read ahead by now
        assert opened.timings == [] and opened.present == [True] * 3
        opened.start()
        opened.layer(engine.ops.shape.num_layers - 1)
        assert opened.timings
    finally:
        opened.close()
