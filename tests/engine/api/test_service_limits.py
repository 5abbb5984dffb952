"""The engine service's hardening, as a real process on 127.0.0.1: size and length limits, the
event loop free while a prompt is tokenized, numerically awkward sampling, fit_context, the
internal token and request guard, /health fields and a KV disk whose writes fail."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import httpx
import pytest

from demo.tiny import random_words
from tests.engine.api.test_service import metric_value, sse_events
from tests.service_process import start_service

TOKEN = "test-internal-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_TEXT_CHARS = 5_000_000
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MODEL_LEN = 1024
MAX_BACKGROUND_CHUNKS = 3


@pytest.fixture(scope="module")
def service(checkpoint_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-limits")
    proc = start_service(
        "engine",
        [
            "--model",
            checkpoint_dir("llama"),  # 1,024 positions, like the review's model
            "--store-path",
            str(tmp / "kv"),
            "--max-num-seqs",
            "1",
            "--max-text-chars",
            str(MAX_TEXT_CHARS),
            "--max-body-bytes",
            str(MAX_BODY_BYTES),
            "--max-background-chunks",
            str(MAX_BACKGROUND_CHUNKS),
        ],
        tmp / "engine.log",
        env={"RAGBLEND_ENGINE_INTERNAL_TOKEN": TOKEN},
    )
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def client(service, timeout_s: float = 120.0) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=timeout_s, headers=AUTH)


def words(count: int, seed: int) -> str:
    return " ".join(random_words(count, seed))


def test_health_answers_while_a_long_question_is_tokenized(service):
    question = words(800_000, 1)[: MAX_TEXT_CHARS - 1]  # ~4.6 M chars: seconds to tokenize
    replies: list[httpx.Response] = []

    def ask() -> None:
        with client(service) as c:
            replies.append(c.post("/v1/generate", json={"question": question}))

    asker = threading.Thread(target=ask)
    asker.start()
    latencies = []
    with client(service) as c:
        while asker.is_alive():
            started = time.monotonic()
            assert c.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.1)
    asker.join()
    assert replies[0].status_code == 422 and "prompt has" in replies[0].json()["detail"]
    assert len(latencies) >= 10, "the question was tokenized too fast to test anything"
    assert max(latencies) < 1.0, f"/health stalled {max(latencies):.1f} s"


def test_texts_above_the_limit_get_422_naming_the_field(service):
    with client(service) as c:
        reply = c.post("/v1/generate", json={"question": "q", "system": "s" * (MAX_TEXT_CHARS + 1)})
        assert reply.status_code == 422
        assert reply.json()["detail"].startswith(f"system: {MAX_TEXT_CHARS + 1} characters")
        chunks = [{"id": "a", "text": "x"}, {"id": "b", "text": "y" * (MAX_TEXT_CHARS + 1)}]
        reply = c.post("/v1/precompute", json={"chunks": chunks})
        assert reply.status_code == 422 and "chunks.1.text" in reply.json()["detail"]


def test_a_body_above_the_limit_gets_413_before_it_is_read(service):
    with client(service) as c:
        reply = c.post(
            "/v1/generate",
            content=b"{" + b" " * MAX_BODY_BYTES + b"}",
            headers={"content-type": "application/json"},
        )
    assert reply.status_code == 413
    assert reply.json() == {
        "detail": f"request body too large: the limit is {MAX_BODY_BYTES} bytes",
        "errors": [],
    }


def test_a_chunk_longer_than_the_positions_is_refused_before_any_compute(service):
    chunks = [{"id": "ok", "text": "kalo zu ka."}, {"id": "huge", "text": words(27_000, 2)}]
    with client(service) as c:
        before = c.get("/health").json()["store"]["memory"]["entries"]
        started = time.monotonic()
        reply = c.post("/v1/precompute", json={"chunks": chunks})
        assert reply.status_code == 422
        detail = reply.json()["detail"]
        assert detail.startswith("chunk 'huge' has ") and "tokens" in detail
        assert time.monotonic() - started < 5
        assert c.get("/health").json()["store"]["memory"]["entries"] == before


def test_a_precompute_the_background_queue_cannot_hold_gets_429_and_queues_nothing(service):
    chunks = [{"id": f"c{i}", "text": words(20, 100 + i)} for i in range(MAX_BACKGROUND_CHUNKS + 1)]
    with client(service) as c:
        before = c.get("/health").json()["store"]["memory"]["entries"]
        reply = c.post("/v1/precompute", json={"chunks": chunks})
        assert reply.status_code == 429 and reply.headers["Retry-After"]
        assert reply.json()["detail"] == (
            f"engine busy: the engine's background queue is full: 0 of {MAX_BACKGROUND_CHUNKS} "
            f"chunk computations wait, {MAX_BACKGROUND_CHUNKS + 1} more asked"
        )
        assert c.get("/health").json()["store"]["memory"]["entries"] == before
        # What fits goes through.
        reply = c.post("/v1/precompute", json={"chunks": chunks[:MAX_BACKGROUND_CHUNKS]})
        assert reply.status_code == 200 and reply.json()["stored"] == MAX_BACKGROUND_CHUNKS


@pytest.mark.parametrize(
    "overrides",
    [
        {"seed": 2**64, "temperature": 0.5},
        {"seed": -(2**63) - 1},
        {"stop": ["s"] * 17},
        {"stop": "x" * 257},
        {"stop": [""]},
        {"question": "\udc00"},
        {"fit_context": 0},
        {"max_tokens": "2"},
    ],
    ids=[
        "seed-2^64",
        "seed-below-int64",
        "17-stops",
        "long-stop",
        "empty-stop",
        "surrogate",
        "int-for-bool",
        "string-for-int",
    ],
)
def test_out_of_range_fields_get_422(service, overrides):
    with client(service) as c:
        # json.dumps escapes a lone surrogate as JSON may carry it ("\\udc00").
        reply = c.post(
            "/v1/generate",
            content=json.dumps({"question": "q", "max_tokens": 2, **overrides}),
            headers={"content-type": "application/json"},
        )
    assert reply.status_code == 422, reply.text


@pytest.mark.parametrize("field", ["temperature", "top_p", "recompute_ratio"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_non_finite_floats_get_422(service, field, value):
    with client(service) as c:
        reply = c.post(
            "/v1/generate",
            content=f'{{"question": "q", "{field}": {value}}}',
            headers={"content-type": "application/json"},
        )
    assert reply.status_code == 422 and field in reply.json()["detail"]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.79e-246},
        {"temperature": 0.5, "top_p": 1e-300},
        {"temperature": 0.5, "top_p": 1e-300, "seed": 2**63 - 1},
        {"temperature": 0.5, "top_p": 1e-300, "seed": -(2**63)},
    ],
    ids=["tiny-temperature", "tiny-top-p", "largest-seed", "smallest-seed"],
)
def test_tiny_temperature_and_top_p_answer_like_greedy(service, sampling):
    ask = {"question": "where is kalo?", "max_tokens": 6, "ignore_eos": True}
    with client(service) as c:
        greedy = c.post("/v1/generate", json=ask)
        sampled = c.post("/v1/generate", json={**ask, **sampling})
    assert greedy.status_code == sampled.status_code == 200, sampled.text
    assert sampled.json()["text"] == greedy.json()["text"]


def test_fit_context_drops_chunks_from_the_end_and_answers_like_the_kept_ones(service):
    chunks = [{"id": f"c{i}", "text": words(300, 10 + i)} for i in range(5)]
    ask = {"question": "what is kalo?", "max_tokens": 8, "mode": "full_prefill"}
    with client(service) as c:
        too_long = c.post("/v1/generate", json={**ask, "chunks": chunks})
        assert too_long.status_code == 422 and "prompt has" in too_long.json()["detail"]
        fitted = c.post("/v1/generate", json={**ask, "chunks": chunks, "fit_context": True})
        assert fitted.status_code == 200, fitted.text
        dropped = fitted.json()["dropped_chunks"]
        assert 0 < dropped < 5
        kept = c.post("/v1/generate", json={**ask, "chunks": chunks[: 5 - dropped]}).json()
        assert kept["dropped_chunks"] == 0
        assert fitted.json()["text"] == kept["text"]
        assert fitted.json()["usage"]["prompt_tokens"] == kept["usage"]["prompt_tokens"]
        body = {**ask, "chunks": chunks, "fit_context": True, "stream": True}
        with c.stream("POST", "/v1/generate", json=body) as streamed:
            name, result = sse_events(streamed)[-1]
        assert name == "result" and result["dropped_chunks"] == dropped
        no_room = {"question": words(2000, 3), "fit_context": True}
        assert c.post("/v1/generate", json=no_room).status_code == 422


def test_best_last_answers_like_the_kept_chunks_reversed_and_other_orders_get_422(service):
    chunks = [{"id": f"c{i}", "text": words(120, 20 + i)} for i in range(5)]
    ask = {"question": "what is kalo?", "max_tokens": 8, "mode": "full_prefill"}
    with client(service) as c:
        body = {**ask, "chunks": chunks, "fit_context": True, "chunk_order": "best_last"}
        best_last = c.post("/v1/generate", json=body)
        assert best_last.status_code == 200, best_last.text
        kept = chunks[: 5 - best_last.json()["dropped_chunks"]]
        assert len(kept) >= 2
        by_hand = c.post("/v1/generate", json={**ask, "chunks": kept[::-1]}).json()
        assert best_last.json()["text"] == by_hand["text"]
        assert best_last.json()["usage"] == by_hand["usage"]
        wrong = c.post("/v1/generate", json={**body, "chunk_order": "worst_first"})
        assert wrong.status_code == 422 and "chunk_order" in wrong.text


def test_the_internal_token_is_required_except_for_health_and_metrics(service):
    with httpx.Client(base_url=service.url, timeout=30) as anonymous:
        reply = anonymous.post("/v1/generate", json={"question": "q", "max_tokens": 1})
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer nope"}
        assert (
            anonymous.post("/v1/precompute", json={"chunks": []}, headers=wrong).status_code == 401
        )
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
    assert TOKEN not in service.log()


def test_plain_text_bodies_get_415_and_foreign_origins_403(service):
    with client(service) as c:
        text = c.post(
            "/v1/generate",
            content=json.dumps({"question": "q"}),
            headers={"content-type": "text/plain"},
        )
        assert text.status_code == 415
        foreign = c.post(
            "/v1/generate", json={"question": "q"}, headers={"Origin": "https://evil.example"}
        )
        assert foreign.status_code == 403


def test_health_reports_positions_queue_estimate_and_write_failures(service, checkpoint_dir):
    long = {"question": "q", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with client(service) as c:
        health = c.get("/health").json()
        assert health["max_model_len"] == MAX_MODEL_LEN
        assert health["queue_estimate_s"] == 0.0
        assert health["kv_write_failures"] == 0
        assert health["store"]["ssd"]["state"] == "ok"
        assert health["model"] == checkpoint_dir("llama").rstrip("/").rsplit("/", 1)[-1]
        assert "/" not in json.dumps(health["model"])
        with c.stream("POST", "/v1/generate", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # decoding now, in the only KV slot
            estimates = [c.get("/health").json()["queue_estimate_s"] for _ in range(3)]
        assert all(e > 0 for e in estimates), estimates


def test_openapi_declares_every_status_a_route_returns(service):
    with client(service) as c:
        paths = c.get("/openapi.json").json()["paths"]
    generate = set(paths["/v1/generate"]["post"]["responses"])
    assert {"200", "400", "401", "403", "413", "415", "422", "429", "499", "500", "503"} <= generate
    precompute = set(paths["/v1/precompute"]["post"]["responses"])
    assert {"200", "400", "401", "403", "413", "415", "422", "429", "500", "503"} <= precompute
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]


@pytest.fixture
def failing_disk_service(checkpoint_dir, tmp_path):
    proc = start_service(
        "engine",
        ["--model", checkpoint_dir("llama"), "--store-path", str(tmp_path / "kv")],
        tmp_path / "engine.log",
    )
    # Writes now fail as on a full or broken disk: a file stands where the folder was.
    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_text("")
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def test_failed_kv_writes_are_reported_by_precompute_health_and_metrics(failing_disk_service):
    chunks = [{"id": f"c{i}", "text": words(20, 40 + i)} for i in range(3)]
    with failing_disk_service.client() as c:
        reply = c.post("/v1/precompute", json={"chunks": chunks})
        assert reply.status_code == 200
        result = reply.json()
        assert (result["stored"], result["skipped"], result["failed"]) == (0, 0, 3)
        health = c.get("/health").json()
        assert health["kv_write_failures"] == 3
        assert health["store"]["ssd"]["state"] == "write_failing"
        assert health["store"]["ssd"]["entries"] == 0
        assert str(failing_disk_service.log_path.parent) not in json.dumps(health)
        assert metric_value(c, "ragblend_engine_kv_write_failures_total", tier="ssd") == 3
        assert metric_value(c, "ragblend_engine_precomputed_chunks_total", result="failed") == 3


def test_history_is_rendered_fitted_by_its_oldest_turns_and_checked(service):
    turns = [
        {"role": role, "text": words(150, 40 + 2 * i + (role == "user"))}
        for i in range(4)
        for role in ("user", "assistant")
    ]
    ask = {"question": "and its river?", "max_tokens": 8, "mode": "full_prefill"}
    with client(service) as c:
        too_long = c.post("/v1/generate", json={**ask, "history": turns})
        assert too_long.status_code == 422 and "prompt has" in too_long.json()["detail"]
        fitted = c.post("/v1/generate", json={**ask, "history": turns, "fit_context": True})
        assert fitted.status_code == 200, fitted.text
        dropped = fitted.json()["dropped_turns"]
        assert dropped in (2, 4, 6) and fitted.json()["dropped_chunks"] == 0
        kept = c.post("/v1/generate", json={**ask, "history": turns[dropped:]}).json()
        assert kept["dropped_turns"] == 0 and fitted.json()["text"] == kept["text"]
        assert fitted.json()["usage"]["prompt_tokens"] == kept["usage"]["prompt_tokens"]
        alone = c.post("/v1/generate", json=ask).json()
        assert alone["usage"]["prompt_tokens"] < kept["usage"]["prompt_tokens"]
        swapped = [turns[1], turns[0]]
        wrong = c.post("/v1/generate", json={**ask, "history": swapped})
        assert wrong.status_code == 422 and "history.0.role" in wrong.json()["detail"]
        unknown = c.post("/v1/generate", json={**ask, "history": [{"role": "tool", "text": "x"}]})
        assert unknown.status_code == 422 and "history" in unknown.text
        long_turn = [{"role": "user", "text": "x" * (MAX_TEXT_CHARS + 1)}, turns[1]]
        refused = c.post("/v1/generate", json={**ask, "history": long_turn})
        assert refused.status_code == 422
        assert refused.json()["detail"].startswith(f"history.0.text: {MAX_TEXT_CHARS + 1} char")
