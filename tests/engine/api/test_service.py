"""The engine service as a real process on 127.0.0.1: contract, errors, queue, disconnects."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.contract import AUTO_RATIO, Selection
from demo.tiny import save_random_checkpoint
from engine.engine import Engine
from engine.types import Chunk, GenerateRequest
from tests.service_process import start_service

CHUNKS = [
    {"id": "a", "text": "kalo vo zuren holds the tas of pe."},
    {"id": "b", "text": "the dri of sol is quber, near the nor."},
    {"id": "c", "text": "gimhu wen ylos trevo anka."},
]
WARM = {"question": "warm up", "max_tokens": 1}


LONG_TOKENS = 4000  # long enough that a generation is still running while a test acts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The tiny llama of the other engine tests, with room for long generations."""
    path = tmp_path_factory.mktemp("engine-service-ckpt")
    save_random_checkpoint("llama", path, seed=1, initializer_range=0.1, max_positions=8192)
    return str(path)


@pytest.fixture(scope="module")
def service(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-service")
    proc = start_service(
        "engine",
        [
            "--model",
            checkpoint,
            "--store-path",
            str(tmp / "kv"),
            "--queue-depth",
            "1",
            "--max-num-seqs",
            "1",
        ],
        tmp / "engine.log",
    )
    yield proc
    # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def body(**overrides) -> dict:
    return {
        "chunks": CHUNKS,
        "question": "what does kalo hold?",
        "max_tokens": 10,
        "recompute_ratio": 0.3,
        **overrides,
    }


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def metric_value(client: httpx.Client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"metric {name} {labels} not exported")


def test_precompute_then_generate_gives_the_python_api_text(service, checkpoint):
    engine = Engine.from_pretrained(checkpoint)
    chunks = tuple(Chunk(c["id"], c["text"]) for c in CHUNKS)
    engine.precompute(chunks)
    engine.generate(GenerateRequest(**WARM))
    expected = engine.generate(
        GenerateRequest(
            question="what does kalo hold?", chunks=chunks, max_tokens=10, recompute_ratio=0.3
        )
    )
    engine.close()

    with service.client() as client:
        stored = client.post("/v1/precompute", json={"chunks": CHUNKS}).json()
        assert stored["stored"] + stored["skipped"] == 3
        again = client.post("/v1/precompute", json={"chunks": CHUNKS}).json()
        assert again == {"stored": 0, "skipped": 3, "failed": 0, "bytes": 0}
        client.post("/v1/generate", json=WARM).raise_for_status()

        reply = client.post("/v1/generate", json=body())
        assert reply.status_code == 200, reply.text
        result = reply.json()
        assert result["text"] == expected.text
        assert result["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
        assert result["usage"]["cached_tokens"] == expected.usage.cached_tokens
        assert result["chunk_tiers"] == ["memory"] * 3
        assert result["blend"] == {
            "recompute_ratio": 0.3,
            "leading_layers": 1,
            "chosen_by": "request",
            "fell_back_to_full_prefill": False,
            "selection": "hkvd",
        }
        assert 0 < result["timings"]["ttft_s"] <= result["timings"]["total_s"]
        assert len(result["timings"]["layers"]) == 4

        with client.stream("POST", "/v1/generate", json=body(stream=True)) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = sse_events(streamed)
        *deltas, (last_name, last) = events
        assert {name for name, _ in deltas} == {"delta"} and last_name == "result"
        assert "".join(d["text"] for _, d in deltas) == last["text"] == expected.text


def test_the_request_id_is_echoed_and_logged(service):
    with service.client() as client:
        reply = client.post(
            "/v1/generate", json=body(max_tokens=2), headers={"X-Request-ID": "trace-4711"}
        )
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == "trace-4711"
    assert "[trace-4711]: generated mode=cacheblend" in service.log()


def test_controller_choice_is_reported_when_no_ratio_is_given(service):
    with service.client() as client:
        client.post("/v1/precompute", json={"chunks": CHUNKS}).raise_for_status()
        result = client.post("/v1/generate", json=body(recompute_ratio=None)).json()
    assert result["blend"]["chosen_by"] == "controller"
    assert 0.15 <= result["blend"]["recompute_ratio"] <= 1.0


@pytest.mark.parametrize("selection", [s.value for s in Selection])
def test_the_blend_reports_the_selection_a_request_asked_for(service, selection):
    with service.client() as client:
        client.post("/v1/precompute", json={"chunks": CHUNKS}).raise_for_status()
        reply = client.post("/v1/generate", json=body(max_tokens=2, selection=selection))
    assert reply.status_code == 200, reply.text
    blend = reply.json()["blend"]
    assert (blend["selection"], blend["chosen_by"], blend["recompute_ratio"]) == (
        selection,
        "request",
        0.3,
    )


# An auto ratio is ⌈r · n⌉ / n of the n blended chunk tokens (here n > 20): up to 1/n over r.
ROUNDING = 0.05


@pytest.mark.parametrize("bound", [None, 0.0])
def test_an_auto_ratio_is_chosen_by_auto_within_its_bound(service, bound):
    auto = body(max_tokens=2, recompute_ratio=AUTO_RATIO, selection="sink")
    if bound is not None:
        auto["max_recompute_ratio"] = bound
    with service.client() as client:
        client.post("/v1/precompute", json={"chunks": CHUNKS}).raise_for_status()
        reply = client.post("/v1/generate", json=auto)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    blend = result["blend"]
    assert blend["chosen_by"] == "auto" and blend["selection"] == "sink"
    if bound is None:  # the engine's auto_max_ratio, 0.5 by default
        assert 0 < blend["recompute_ratio"] <= 0.5 + ROUNDING
    else:  # a bound of 0 recomputes none of the cached chunks
        assert blend["recompute_ratio"] == 0 and result["usage"]["recomputed_tokens"] == 0


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"chunks": CHUNKS}, "question"),
        (body(recompute_ratio=1.5), "recompute_ratio"),
        (body(recompute_ratio="fast"), "recompute_ratio"),
        (body(recompute_ratio="0.3"), "recompute_ratio"),
        (body(selection="best"), "selection"),
        (body(selection=1), "selection"),
        (body(max_recompute_ratio=0.2), "max_recompute_ratio"),
        (body(recompute_ratio=None, max_recompute_ratio=0.2), "max_recompute_ratio"),
        (body(recompute_ratio=AUTO_RATIO, max_recompute_ratio=2), "max_recompute_ratio"),
        (body(mode="turbo"), "mode"),
        (body(max_tokens=0), "max_tokens"),
        (body(top_p=0), "top_p"),
        (body(chunks=[{"id": "x", "text": ""}]), "chunks.0.text"),
        (body(max_tokens=100_000), "max_tokens"),
        (body(chunks=[{"id": "big", "text": "kalo zu " * 9000}]), "prompt has"),
    ],
)
def test_bad_requests_get_422_naming_the_field(service, payload, field):
    with service.client() as client:
        reply = client.post("/v1/generate", json=payload)
    assert reply.status_code == 422
    assert field in reply.json()["detail"]


def test_malformed_json_gets_422(service):
    with service.client() as client:
        reply = client.post(
            "/v1/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert reply.status_code == 422


def test_a_full_queue_gets_429_with_a_retry_after_of_when_the_running_generation_ends(service):
    long = body(max_tokens=LONG_TOKENS, ignore_eos=True, stream=True)
    with service.client() as first, service.client() as second, service.client() as third:
        running = first.stream("POST", "/v1/generate", json=long)
        waiting = second.stream("POST", "/v1/generate", json=long)
        with running as running_reply, waiting as waiting_reply:
            running_lines = running_reply.iter_lines()  # kept: dropping it closes the stream
            next(running_lines)  # the first generation runs
            assert waiting_reply.status_code == 200  # queued behind it (queue depth 1)
            deadline = time.monotonic() + 10
            while metric_value(third, "ragblend_engine_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = third.post("/v1/generate", json=body())
            assert refused.status_code == 429
            # The running generation has ~LONG_TOKENS to go: seconds at any step time above
            # 0.25 ms; bounded by a minute.
            assert 2 <= int(refused.headers["retry-after"]) <= 60
            assert "busy" in refused.json()["detail"]


def test_a_disconnected_stream_frees_the_worker(service):
    with service.client() as client:
        before = metric_value(client, "ragblend_engine_generation_tokens_total")
        with client.stream(
            "POST", "/v1/generate", json=body(max_tokens=800, ignore_eos=True, stream=True)
        ) as reply:
            lines = reply.iter_lines()
            next(lines)
        # The connection is closed here, long before the last token.
        deadline = time.monotonic() + 10
        while metric_value(client, "ragblend_engine_requests_running") or metric_value(
            client, "ragblend_engine_requests_waiting"
        ):
            assert time.monotonic() < deadline, "the worker kept generating for a gone client"
            time.sleep(0.05)
        started = time.monotonic()
        quick = client.post("/v1/generate", json=body(max_tokens=2))
        assert quick.status_code == 200 and time.monotonic() - started < 5
        generated = metric_value(client, "ragblend_engine_generation_tokens_total") - before
        assert generated < LONG_TOKENS


def test_metrics_parse_and_count_traffic(service):
    with service.client() as client:
        before = (
            metric_value(
                client,
                "ragblend_engine_requests_total",
                mode="full_prefill",
                finish_reason="length",
            )
            if _has(client, "full_prefill")
            else 0.0
        )
        client.post(
            "/v1/generate", json=body(mode="full_prefill", max_tokens=3, ignore_eos=True)
        ).raise_for_status()
        after = metric_value(
            client, "ragblend_engine_requests_total", mode="full_prefill", finish_reason="length"
        )
        assert after == before + 1
        assert metric_value(client, "ragblend_engine_ttft_seconds_count", mode="full_prefill") >= 1
        assert metric_value(client, "ragblend_engine_store_entries", tier="memory") >= 3
        hits = metric_value(client, "ragblend_engine_kv_lookups_total", tier="memory", result="hit")
        assert hits >= 3
        assert metric_value(client, "ragblend_engine_kv_chunks_total") >= hits


def _has(client: httpx.Client, mode: str) -> bool:
    return f'mode="{mode}"' in client.get("/metrics").text


@pytest.fixture(scope="module")
def batching_service(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-batching")
    proc = start_service(
        "engine",
        ["--model", checkpoint, "--store-path", str(tmp / "kv"), "--max-num-seqs", "4"],
        tmp / "engine.log",
    )
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def test_concurrent_streams_interleave_token_by_token(batching_service):
    """Two streams started together both make progress before either ends, and the engine
    reports decode steps that carried both."""
    arrivals: list[tuple[float, int]] = []
    lock = threading.Lock()
    long = body(max_tokens=60, ignore_eos=True, stream=True)

    def consume(index: int) -> None:
        with (
            batching_service.client() as client,
            client.stream("POST", "/v1/generate", json=long) as reply,
        ):
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("event: delta"):
                    with lock:
                        arrivals.append((time.monotonic(), index))

    with batching_service.client() as client:
        client.post("/v1/generate", json=WARM).raise_for_status()
    threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    order = [index for _, index in sorted(arrivals)]
    last = {i: max(k for k, x in enumerate(order) if x == i) for i in (0, 1)}
    first = {i: order.index(i) for i in (0, 1)}
    assert first[1] < last[0] and first[0] < last[1], "one stream finished before the other began"
    switches = sum(1 for a, b in zip(order, order[1:], strict=False) if a != b)
    assert switches >= 10, f"the streams alternated only {switches} times: {order}"
    with batching_service.client() as client:
        decode_steps = metric_value(client, "ragblend_engine_batch_size_count", step="decode")
        single = metric_value(client, "ragblend_engine_batch_size_bucket", step="decode", le="1.0")
        assert decode_steps - single >= 10  # decode steps that carried both sequences
        # The pool holds max_num_seqs sequences of max_model_len in blocks of 16, no more.
        model_len = client.get("/health").json()["max_model_len"]
        assert metric_value(client, "ragblend_engine_kv_pool_blocks") == 4 * -(-model_len // 16)
        # The streams' template start and system prompt stay in the pool, shared.
        prefix_blocks = "ragblend_engine_kv_shared_prefix_blocks"
        states = ("shared", "idle")
        assert sum(metric_value(client, prefix_blocks, state=s) for s in states) >= 1


@pytest.fixture(scope="module")
def auto_service(checkpoint, tmp_path_factory):
    """An engine whose settings pick the blend of requests that leave it unset: auto ratios
    covering all of the score mass, at most 0.2, over sink tokens."""
    tmp = tmp_path_factory.mktemp("engine-auto")
    blend = {
        "--recompute-ratio": "auto",
        "--selection": "sink",
        "--auto-coverage": "1.0",
        "--auto-max-ratio": "0.2",
    }
    args = ["--model", checkpoint, "--store-path", str(tmp / "kv")]
    args += [arg for flag_value in blend.items() for arg in flag_value]
    proc = start_service("engine", args, tmp / "engine.log")
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def blend_of(service, **overrides) -> dict:
    with service.client() as client:
        client.post("/v1/precompute", json={"chunks": CHUNKS}).raise_for_status()
        reply = client.post("/v1/generate", json=body(max_tokens=2, **overrides))
    assert reply.status_code == 200, reply.text
    return reply.json()["blend"]


def test_the_engine_settings_pick_the_blend_a_request_leaves_unset(auto_service):
    blend = blend_of(auto_service, recompute_ratio=None)
    assert (blend["chosen_by"], blend["selection"]) == ("auto", "sink")
    assert 0 < blend["recompute_ratio"] <= 0.2 + ROUNDING  # auto_max_ratio
    asked = blend_of(auto_service, recompute_ratio=0.3, selection="hkvd")
    assert (asked["chosen_by"], asked["selection"], asked["recompute_ratio"]) == (
        "request",
        "hkvd",
        0.3,
    )


def test_auto_coverage_sets_how_much_an_auto_ratio_recomputes(auto_service):
    auto = {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 1.0, "selection": "hkvd"}
    # Covering all of the deviation takes every blended token (the default, 0.8, takes fewer:
    # tests/engine/blend/test_blend_selections.py). Not compared with another engine's: the
    # controller's floor and check layers come from what each engine has timed.
    blend = blend_of(auto_service, **auto)
    assert (blend["chosen_by"], blend["recompute_ratio"]) == ("auto", pytest.approx(1.0))
