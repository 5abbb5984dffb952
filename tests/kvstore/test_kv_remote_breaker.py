"""The remote tier's circuit breaker on a real redis-server: calls failing together back off
once, and a probe that fails in an unexpected way does not keep the breaker open."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.remote_tier import RemoteTier
from tests.kvstore.kv_testutil import FINGERPRINT, key_of
from tests.redis_server import RedisServer, redis_server

KEY = key_of(0)
FIRST_BACKOFF_S = 1.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as started:
        yield started


def test_calls_failing_together_on_a_hung_redis_back_off_once(server: RedisServer) -> None:
    tier = RemoteTier(server.url, FINGERPRINT, timeout_s=0.5, backoff_s=FIRST_BACKOFF_S)
    assert tier.ping()
    callers = 4
    start = threading.Barrier(callers)

    def look_up() -> None:
        start.wait()
        assert KEY not in tier  # a timeout: a miss

    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        threads = [threading.Thread(target=look_up) for _ in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not tier.reachable and "Timeout" in (tier.last_error or "")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    # One back-off for the four failures (not 1 + 2 + 4 + 8 s): the next call after it probes.
    time.sleep(FIRST_BACKOFF_S + 0.3)
    assert tier.ping() and tier.reachable


def test_a_probe_failing_unexpectedly_leaves_the_next_call_free_to_probe(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = RemoteTier(server.url, FINGERPRINT, backoff_s=FIRST_BACKOFF_S)
    server.stop(signal.SIGKILL)
    assert KEY not in tier and not tier.reachable  # the breaker is open
    server.start()
    time.sleep(FIRST_BACKOFF_S + 0.3)

    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("not a Redis error")

    monkeypatch.setattr(tier._client, "pipeline", broken)  # the probe's lookup fails oddly
    with pytest.raises(RuntimeError):
        KEY in tier  # noqa: B015 - the lookup is the probe
    monkeypatch.undo()
    assert tier.ping() and tier.reachable  # the next call probes again, and Redis is back
