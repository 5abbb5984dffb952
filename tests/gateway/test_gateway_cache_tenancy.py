"""Tenants do not learn each other's passages through the cache: with API keys, a passage's KV
is stored under its key's scope, so a second key's identical passage is computed afresh (no
cached tokens) in the engine's local tiers and in a Redis tier that two engines share; keys of
one scope, and cache_sharing=shared, reuse it."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis

from tests.redis_server import RedisServer

ALICE, BOB, CAROL = "alice-cache-key", "bob-cache-key", "carol-cache-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    """alice, bob and carol may all use collection a: only the key tells them apart. Their
    names are this module's own: a key's name is its cache scope, and other test files ask the
    same engine with keys named alice and bob."""
    path = tmp_path_factory.mktemp("cache-keys") / "keys.json"
    run = uuid.uuid4().hex[:8]
    entries = [
        {"name": f"alice-{run}", "key": ALICE, "collections": ["a"]},
        {"name": f"bob-{run}", "key": BOB, "collections": ["a"]},
        {"name": f"carol-{run}", "key": CAROL, "collections": ["a"]},
    ]
    path.write_text(json.dumps(entries))
    return str(path)


def passage(tag: str) -> list[dict]:
    """A passage no other test sends: nothing of it is cached before the test."""
    return [{"id": "memo", "text": f"Memo {tag}: the tenant's ledger lists nine silver coins."}]


def ask(url: str, key: str, documents: list[dict]) -> dict:
    body = {
        "question": "How many coins does the ledger list?",
        "documents": documents,
        "retrieval": "none",
        "max_tokens": 2,
    }
    with httpx.Client(base_url=url, timeout=120) as http:
        response = http.post("/v1/query", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    return response.json()


def until_cached(url: str, key: str, documents: list[dict]) -> dict:
    """The key's answer once its passage's KV is found (its write-back runs behind it)."""
    answer: dict = {}
    for _ in range(50):
        answer = ask(url, key, documents)
        if None not in answer["chunk_tiers"]:
            return answer
        time.sleep(0.1)
    raise AssertionError(f"the passage's KV was never found: {answer}")


@pytest.fixture(scope="module")
def keyed(spawn_gateway, engine, keys_file):
    return spawn_gateway(engine, args=("--api-keys-file", keys_file))


def test_a_second_keys_identical_passage_is_not_served_from_the_first_keys_cache(keyed):
    documents = passage(uuid.uuid4().hex)
    first = ask(keyed.url, ALICE, documents)
    assert first["usage"]["cached_tokens"] == 0
    assert until_cached(keyed.url, ALICE, documents)["usage"]["cached_tokens"] > 0
    other = ask(keyed.url, BOB, documents)
    assert set(other["chunk_tiers"]) == {None}
    assert other["usage"]["cached_tokens"] == 0  # nor its prompt prefix


def test_a_cache_salt_scopes_a_keys_passages_further(keyed):
    documents = passage(uuid.uuid4().hex)
    with httpx.Client(base_url=keyed.url, timeout=120) as http:
        body = {
            "messages": [{"role": "user", "content": "How many coins?"}],
            "max_tokens": 2,
            "rag": {"documents": documents, "retrieval": "none"},
        }
        cached = 0
        for _ in range(50):
            reply = http.post("/v1/chat/completions", json=body, headers=bearer(ALICE))
            assert reply.status_code == 200, reply.text
            cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached:
                break
            time.sleep(0.1)
        assert cached > 0
        salted = http.post(
            "/v1/chat/completions", json={**body, "cache_salt": "user-7"}, headers=bearer(ALICE)
        )
    assert salted.status_code == 200, salted.text
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def shared(spawn_gateway, engine, keys_file):
    return spawn_gateway(engine, args=("--api-keys-file", keys_file, "--cache-sharing", "shared"))


def test_keys_share_the_cache_where_the_operator_says_so(shared):
    documents = passage(uuid.uuid4().hex)
    until_cached(shared.url, ALICE, documents)
    assert None not in ask(shared.url, CAROL, documents)["chunk_tiers"]


@pytest.fixture(scope="module")
def redis_pair(spawn_engine, spawn_gateway, keys_file, tmp_path_factory):
    """Two engines on one Redis, each behind its own keyed gateway: what the second engine
    finds of the first's KV it found in Redis."""
    server = RedisServer(tmp_path_factory.mktemp("tenancy-redis")).start()
    env = {"RAGBLEND_ENGINE_REMOTE_URL": server.url}
    engines = [spawn_engine(env=env), spawn_engine(env=env)]
    gateways = [spawn_gateway(e, args=("--api-keys-file", keys_file)) for e in engines]
    yield server, gateways
    server.stop()


def test_the_redis_tier_serves_a_passage_to_its_own_key_only(redis_pair):
    server, (first, second) = redis_pair
    stored = redis.Redis.from_url(server.url)
    documents = passage(uuid.uuid4().hex)
    before = set(stored.scan_iter(match="ragblend:kv:*"))
    # Computed on the first engine, each chunk written back to Redis.
    num_chunks = len(ask(first.url, ALICE, documents)["chunk_tiers"])
    deadline = time.monotonic() + 60
    while len(set(stored.scan_iter(match="ragblend:kv:*")) - before) < num_chunks:
        assert time.monotonic() < deadline, "the write-back never reached Redis"
        time.sleep(0.1)
    other = ask(second.url, BOB, documents)
    assert set(other["chunk_tiers"]) == {None} and other["usage"]["cached_tokens"] == 0
    own = ask(second.url, ALICE, documents)
    assert set(own["chunk_tiers"]) == {"remote"} and own["usage"]["cached_tokens"] > 0
