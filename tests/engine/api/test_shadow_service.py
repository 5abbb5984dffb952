"""The engine service as a real process with shadow checks on: /metrics shows every shadow series
from the start, and the check of a sampled request once it has run."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service_process import start_service

CHUNKS = [
    {"id": "a", "text": "kalo vo zuren holds the tas of pe."},
    {"id": "b", "text": "the dri of sol is quber, near the nor."},
]


@pytest.fixture(scope="module")
def service(checkpoint_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-shadow-service")
    proc = start_service(
        "engine",
        [
            "--model",
            checkpoint_dir("llama"),
            "--store-path",
            str(tmp / "kv"),
            "--shadow-fraction",
            "1.0",
            "--shadow-max-tokens",
            "4",
            "--shadow-max-share",
            "1.0",
        ],
        tmp / "engine.log",
    )
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every `ragblend_engine_shadow_*` sample: (name, sorted labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("ragblend_engine_shadow_"):
                found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def wait_for_checks(client: httpx.Client, mode: str, count: int) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = samples(client)
        if found.get(("ragblend_engine_shadow_checks_total", (("mode", mode),)), 0) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {count} shadow checks of {mode} in /metrics: {samples(client)}")


def test_metrics_show_the_shadow_series_after_a_sampled_request(service):
    with service.client() as client:
        assert client.post("/v1/precompute", json={"chunks": CHUNKS}).status_code == 200
        before = samples(client)
        for reason in ("busy", "queue_full", "budget", "memory", "preempted", "error"):
            assert before["ragblend_engine_shadow_skipped_total", (("reason", reason),)] == 0
        assert before["ragblend_engine_shadow_checks_total", (("mode", "cacheblend"),)] == 0
        assert before["ragblend_engine_shadow_eligible_total", (("mode", "cacheblend"),)] == 0
        assert before["ragblend_engine_shadow_coverage", (("mode", "full_reuse"),)] == 0
        assert before["ragblend_engine_shadow_answer_kl_count", (("mode", "cacheblend"),)] == 0
        assert before["ragblend_engine_shadow_kv_bytes", ()] == 0

        full = {"chunks": CHUNKS, "question": "what does kalo hold?", "max_tokens": 4}
        assert client.post("/v1/generate", json=full | {"mode": "full_prefill"}).status_code == 200
        reply = client.post("/v1/generate", json=full | {"recompute_ratio": 1.0})
        assert reply.status_code == 200, reply.text
        found = wait_for_checks(client, "cacheblend", 1)

    def value(name: str, **labels: str) -> float:
        return found[name, tuple(sorted(labels.items()))]

    cacheblend = {"mode": "cacheblend"}
    assert value("ragblend_engine_shadow_checks_total", mode="full_reuse") == 0
    assert value("ragblend_engine_shadow_first_token_agreements_total", **cacheblend) == 1
    assert value("ragblend_engine_shadow_topk_agreement_count", **cacheblend) == 1
    # r = 1 is full prefill: every top-k token agrees, KL below the first bucket.
    assert value("ragblend_engine_shadow_topk_agreement_bucket", le="0.99", **cacheblend) == 0
    assert value("ragblend_engine_shadow_kl_divergence_bucket", le="1e-06", **cacheblend) == 1
    assert value("ragblend_engine_shadow_greedy_agreement_sum", **cacheblend) == 1.0
    assert value("ragblend_engine_shadow_seconds_total") > 0
    assert value("ragblend_engine_shadow_pending") == 0
    assert value("ragblend_engine_shadow_kv_bytes") == 0
    # The full_prefill request was not eligible: one eligible request, checked.
    assert value("ragblend_engine_shadow_eligible_total", **cacheblend) == 1
    assert value("ragblend_engine_shadow_coverage", **cacheblend) == 1.0
    # Teacher-forced over full prefill's 4-token answer: no deviation at r = 1.
    assert value("ragblend_engine_shadow_answer_kl_bucket", le="1e-06", **cacheblend) == 1
    assert value("ragblend_engine_shadow_answer_argmax_agreement_sum", **cacheblend) == 1.0
