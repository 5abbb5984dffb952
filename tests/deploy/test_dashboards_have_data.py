"""Every Grafana panel's PromQL returns data from a real Prometheus scraping a real stack after
traffic in every mode, and every alert expression is valid PromQL that Prometheus evaluates."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy.deploy_files import alert_rules, grafana_to_promql, panel_targets
from tests.deploy.prometheus_server import PrometheusServer, start_prometheus
from tests.gateway.gateway_testutil import DOCUMENTS, wait_precomputed
from tests.service_process import Service

MODES = ("cacheblend", "full_prefill", "prefix_cache", "full_reuse")
# The engine refuses longer answers, so one query gets a 422 that the gateway counts as an
# upstream error of the engine (the "errors by dependency" panel).
ENGINE_MAX_TOKENS = "8"


@pytest.fixture(scope="module")
def stack(checkpoint_dir, tmp_path_factory) -> Iterator[dict[str, Service]]:
    """Retriever, engine and gateway of the tiny checkpoint on free loopback ports."""
    model = checkpoint_dir("llama")
    logs = tmp_path_factory.mktemp("deploy-logs")
    retriever = Service(
        "retriever",
        [
            "--data-dir",
            str(tmp_path_factory.mktemp("index")),
            "--tokenizer",
            model,
            "--chunk-tokens",
            "48",
        ],
        logs / "retriever.log",
    )
    engine = Service(
        "engine",
        ["--model", model, "--store-path", str(tmp_path_factory.mktemp("kv"))],
        logs / "engine.log",
        # Every blended request shadow-checked, so the shadow panels have data.
        env={
            "RAGBLEND_ENGINE_MAX_TOKENS_LIMIT": ENGINE_MAX_TOKENS,
            "RAGBLEND_ENGINE_SHADOW_FRACTION": "1.0",
            "RAGBLEND_ENGINE_SHADOW_MAX_SHARE": "1.0",
        },
    )
    started = []
    try:
        for service in (retriever, engine):
            started.append(service.start())
        gateway = Service(
            "gateway",
            [
                "--retriever-url",
                retriever.url,
                "--engine-urls",
                engine.url,
                "--default-top-k",
                "2",
                "--default-max-tokens",
                "4",
            ],
            logs / "gateway.log",
        )
        started.append(gateway.start())
        yield {"retriever": retriever, "engine": engine, "gateway": gateway}
    finally:
        for service in reversed(started):
            service.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory) -> Iterator[PrometheusServer]:
    targets = {name: f"127.0.0.1:{service.port}" for name, service in stack.items()}
    server = start_prometheus(targets, tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


def send_traffic(client: httpx.Client) -> None:
    """Queries in every mode, streamed and not, an OpenAI chat, and one engine rejection."""
    for mode in MODES:
        response = client.post(
            "/v1/query", json={"question": "Where does the Zorblax river flow?", "mode": mode}
        )
        assert response.status_code == 200, response.text
        streamed = client.post(
            "/v1/query", json={"question": "What grows in Melbrook?", "mode": mode, "stream": True}
        )
        assert streamed.status_code == 200, streamed.text
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "ragblend",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "How do travelers cross the Vantir mountains?"}
            ],
        },
    )
    assert chat.status_code == 200, chat.text
    rejected = client.post(
        "/v1/query",
        json={"question": "Tell me about Quendor.", "max_tokens": 2 * int(ENGINE_MAX_TOKENS)},
    )
    assert rejected.status_code == 422, rejected.text


def wait_for_scrapes(prometheus: PrometheusServer, count: int = 3) -> None:
    """Until every target was scraped `count` more times (1 s interval)."""
    time.sleep(count * 1.2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = prometheus.query('up{job=~"gateway|retriever|engine"} == 1')["data"]["result"]
        if len(result) == 3:
            return
        time.sleep(0.5)
    raise AssertionError(f"not every target is up: {prometheus.get('/api/v1/targets')}")


@pytest.fixture(scope="module")
def scraped(stack, prometheus) -> PrometheusServer:
    """Prometheus after an ingest and two rounds of traffic a few scrapes apart, so that
    every rate has at least two samples that differ."""
    with httpx.Client(base_url=stack["gateway"].url, timeout=120.0) as client:
        wait_for_scrapes(prometheus)
        for doc_id, text in DOCUMENTS.items():
            response = client.post("/v1/documents", json={"text": text, "id": doc_id})
            assert response.status_code == 200, response.text
        for doc_id in DOCUMENTS:
            assert wait_precomputed(client, doc_id)["precompute"]["status"] == "ready"
        for _ in range(2):
            send_traffic(client)
            wait_for_scrapes(prometheus)
    return prometheus


@pytest.mark.parametrize(("panel", "expr"), panel_targets(), ids=[p for p, _ in panel_targets()])
def test_every_dashboard_panel_query_returns_data(scraped, panel, expr):
    answer = scraped.query(grafana_to_promql(expr))
    assert answer["status"] == "success", f"{panel}: {answer}"
    values = [float(sample["value"][1]) for sample in answer["data"]["result"]]
    assert values, f"{panel}: no series for {expr}"
    assert any(not math.isnan(v) for v in values), f"{panel}: only NaN for {expr}"


@pytest.mark.parametrize(("alert", "expr"), alert_rules(), ids=[a for a, _ in alert_rules()])
def test_every_alert_expression_is_valid_promql(scraped, alert, expr):
    answer = scraped.query(expr)
    assert answer["status"] == "success", f"{alert}: {answer}"


def test_prometheus_loads_and_evaluates_every_alert_rule_without_error(scraped):
    time.sleep(1.5)  # one more rule evaluation (1 s)
    groups = scraped.get("/api/v1/rules")["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(rules) == {name for name, _ in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
