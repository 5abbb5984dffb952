"""Shadow checks: a blend at r = 1 agrees with full prefill, also teacher-forced, full reuse
disagrees on the demo's context questions; under load a check keeps its share of the steps (or,
without one, is skipped or dropped), and the shadow's KV stays within its budget."""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time

import pytest

from demo import MODEL_DIR
from demo.corpus import held_out
from demo.evaluate import as_chunks
from demo.tiny import random_words
from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.quality.shadow import Shadow, ShadowConfig, ShadowReport, ShadowSample
from engine.types import Chunk, GenerateRequest, Mode

# Demo context questions: the answer sits in a passage that names its subject only by a
# pronoun, so reading it needs the passage before it (cross-chunk attention).
CONTEXT_QUESTIONS = [e for e in held_out(30) if e.kind == "context"]
GREEDY_TOKENS = 8


class Reports:
    """The engine's shadow reports, in order, as they finish on the worker thread."""

    def __init__(self, engine: Engine):
        self._queue: queue.SimpleQueue[ShadowReport] = queue.SimpleQueue()
        engine.shadow.add_listener(self._queue.put)

    def next(self) -> ShadowReport:
        return self._queue.get(timeout=120)


@pytest.fixture(scope="module")
def demo():
    """The demo model, every eligible request checked; the shadow prefills in pieces of 16
    tokens, so the r = 1 test also pins that the pieces add up to one full prefill."""
    config = ShadowConfig(fraction=1.0, max_share=1.0, max_tokens=GREEDY_TOKENS, piece_tokens=16)
    engine = Engine.from_pretrained(str(MODEL_DIR), shadow=config)
    for example in CONTEXT_QUESTIONS:
        engine.precompute(as_chunks(example.passages))
    yield engine, Reports(engine)
    engine.close()


def ask(engine: Engine, example, mode: Mode, ratio: float | None = None, **options):
    return engine.generate(
        GenerateRequest(
            question=example.question,
            chunks=as_chunks(example.passages),
            mode=mode,
            recompute_ratio=ratio,
            **options,
        )
    )


def test_a_blend_at_ratio_one_fully_agrees_with_full_prefill(demo):
    engine, reports = demo
    for example in CONTEXT_QUESTIONS[:4]:
        # Past EOS, so that every one of the greedy tokens is compared.
        ask(engine, example, Mode.CACHEBLEND, 1.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        report = reports.next()
        assert report.mode is Mode.CACHEBLEND
        assert report.first_token_agrees
        assert report.topk_agreement == 1.0
        assert report.kl_divergence < 1e-9
        assert report.greedy_tokens == GREEDY_TOKENS and report.greedy_agreement == 1.0
        assert report.answer_tokens == GREEDY_TOKENS
        assert report.answer_kl < 1e-9 and report.answer_argmax_agreement == 1.0


def test_full_reuse_disagrees_with_full_prefill_on_context_questions(demo):
    engine, reports = demo
    reuse, blend = [], []
    for example in CONTEXT_QUESTIONS:
        ask(engine, example, Mode.FULL_REUSE, max_tokens=4)
        reuse.append(reports.next())
        ask(engine, example, Mode.CACHEBLEND, 1.0, max_tokens=4)
        blend.append(reports.next())
    assert all(r.mode is Mode.FULL_REUSE for r in reuse)
    # Measured: full reuse agrees on 4 of 10 first tokens, top-k 0.2, mean KL 4.9 nats (max 12.7),
    # greedy 0.4; a blend at r = 0.15 on 10 of 10, KL 8e-7; at r = 1 KL ~1e-15 (float rounding).
    assert statistics.fmean(r.first_token_agrees for r in reuse) <= 0.7
    assert statistics.fmean(r.topk_agreement for r in reuse) < 0.8
    assert statistics.fmean(r.kl_divergence for r in reuse) > 0.5
    assert statistics.fmean(r.greedy_agreement or 0.0 for r in reuse) <= 0.7
    # Teacher-forced over 8 answer tokens, measured: full reuse mean KL 1.03, argmax 0.84; a
    # blend at r = 0.15 0.05 and 0.96 (its first-token KL is 8e-7); at r = 1 1e-13 and 1.
    assert statistics.fmean(r.answer_kl for r in reuse) > 0.3
    assert statistics.fmean(r.answer_argmax_agreement for r in reuse) < 0.95
    assert all(r.answer_kl < 1e-9 and r.answer_argmax_agreement == 1.0 for r in blend)
    assert all(r.first_token_agrees and r.kl_divergence < 1e-9 for r in blend)


def test_a_request_that_does_not_decode_greedily_is_checked_on_its_first_logits_only(demo):
    engine, reports = demo
    ask(engine, CONTEXT_QUESTIONS[0], Mode.CACHEBLEND, 1.0, temperature=1.0, seed=3)
    report = reports.next()
    assert report.first_token_agrees and report.kl_divergence < 1e-9
    assert report.greedy_agreement is None and report.greedy_tokens == 0


def test_full_prefill_and_prefix_cache_requests_are_never_sampled(demo):
    engine, reports = demo
    before = dict(engine.shadow.stats.checks)
    for mode in (Mode.FULL_PREFILL, Mode.PREFIX_CACHE):
        ask(engine, CONTEXT_QUESTIONS[0], mode, max_tokens=2)
    ask(engine, CONTEXT_QUESTIONS[0], Mode.FULL_REUSE, max_tokens=2)
    assert reports.next().mode is Mode.FULL_REUSE  # the first report after the two skipped
    assert engine.shadow.stats.checks[Mode.FULL_REUSE] == before[Mode.FULL_REUSE] + 1
    assert engine.shadow.stats.checks[Mode.CACHEBLEND] == before[Mode.CACHEBLEND]


# -- under load: tiny random llama with room for long prompts ------------------------------------


def long_chunks(count: int, words: int) -> tuple[Chunk, ...]:
    return tuple(Chunk(f"w{i}", " ".join(random_words(words, 50 + i))) for i in range(count))


def test_without_a_share_of_busy_steps_a_request_finishing_under_load_is_skipped(tiny_model):
    engine = Engine.from_pretrained(
        tiny_model,
        max_num_seqs=2,
        shadow=ShadowConfig(fraction=1.0, max_share=1.0, every_steps=0),
    )
    try:
        long_answer: list = []
        # 400 tokens: still decoding when the short request, queued right after, is done.
        runner = threading.Thread(
            target=lambda: long_answer.append(
                engine.generate(
                    GenerateRequest(
                        "keep talking", mode=Mode.FULL_PREFILL, max_tokens=400, ignore_eos=True
                    )
                )
            )
        )
        runner.start()
        while engine.num_running + engine.num_waiting == 0:
            threading.Event().wait(0.001)
        short = engine.generate(GenerateRequest("short", chunks=long_chunks(2, 20), max_tokens=1))
        runner.join()
        stats = engine.shadow.stats
        assert short.finish_reason == "length"
        assert long_answer[0].usage.completion_tokens == 400
        assert stats.skipped["busy"] == 1, stats
        assert sum(stats.checks.values()) == 0 and stats.seconds == 0.0
        assert engine.shadow.pending == 0
    finally:
        engine.close()


def test_without_a_share_of_busy_steps_a_request_arriving_drops_the_shadow(tiny_model):
    # Pieces of one token over a ~2000-token prompt: the shadow is still running (or queued)
    # when the next request arrives right after the first one's answer.
    config = ShadowConfig(fraction=1.0, max_share=1.0, piece_tokens=1, every_steps=0)
    engine = Engine.from_pretrained(tiny_model, shadow=config)
    try:
        first = engine.generate(GenerateRequest("first", chunks=long_chunks(4, 200), max_tokens=1))
        assert first.usage.prompt_tokens > 1500
        deadline = time.monotonic() + 30
        while engine.shadow.pending == 0 and time.monotonic() < deadline:
            threading.Event().wait(0.001)  # queued once the step that answered it is over
        assert engine.shadow.pending == 1, engine.shadow.stats
        second = engine.generate(GenerateRequest("second", mode=Mode.FULL_PREFILL, max_tokens=3))
        stats = engine.shadow.stats
        assert second.finish_reason in ("length", "stop")
        assert stats.skipped["preempted"] == 1, stats
        assert sum(stats.checks.values()) == 0
        assert engine.shadow.pending == 0
    finally:
        engine.close()


def test_with_a_share_of_busy_steps_a_check_completes_while_other_requests_run(tiny_model):
    config = ShadowConfig(fraction=1.0, max_share=1.0, max_tokens=4, every_steps=1)
    engine = Engine.from_pretrained(tiny_model, max_num_seqs=2, shadow=config)
    busy_at_report: list[bool] = []
    engine.shadow.add_listener(lambda report: busy_at_report.append(engine.scheduler.has_work))
    try:
        long_answer: list = []
        runner = threading.Thread(
            target=lambda: long_answer.append(
                engine.generate(
                    GenerateRequest(
                        "keep talking", mode=Mode.FULL_PREFILL, max_tokens=400, ignore_eos=True
                    )
                )
            )
        )
        runner.start()
        while engine.num_running + engine.num_waiting == 0:
            threading.Event().wait(0.001)
        short = engine.generate(GenerateRequest("short", chunks=long_chunks(2, 20), max_tokens=1))
        runner.join()
        stats = engine.shadow.stats
        assert short.finish_reason == "length"
        assert long_answer[0].usage.completion_tokens == 400
        # Checked on its share of the 400 decode steps, before the long request ended.
        assert busy_at_report == [True], stats
        assert stats.checks[Mode.CACHEBLEND] == stats.eligible[Mode.CACHEBLEND] == 1
        assert sum(stats.skipped.values()) == 0
        assert engine.shadow.pending == 0 and engine.shadow.kv_bytes == 0
    finally:
        engine.close()


# -- the Shadow's own bounds, on a real model runner ---------------------------------------------


def finished_sample(engine: Engine, prompt_tokens: int = 40) -> ShadowSample:
    """A sample as a finished greedy request leaves it (logits of a real prefill)."""
    layout = engine.layout(GenerateRequest("q", chunks=long_chunks(2, prompt_tokens // 4)))
    output = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.FULL_PREFILL))).output
    sample = ShadowSample(Mode.CACHEBLEND, layout.token_ids, True, 2, (output.keys, output.values))
    sample.observe(output.logits, int(output.logits.argmax()))
    return sample


def test_a_full_queue_skips_new_samples_and_preempt_drops_every_pending_check(engine_for):
    engine = engine_for("llama")
    config = ShadowConfig(fraction=1.0, max_queue=2, max_share=1.0, piece_tokens=8, every_steps=0)
    shadow = Shadow(engine.ops, config)
    for _ in range(3):
        shadow.submit(finished_sample(engine), busy=False)
    assert shadow.pending == 2 and shadow.stats.skipped["queue_full"] == 1
    assert shadow.run_piece()  # the first check is in progress
    shadow.preempt()
    assert shadow.pending == 0 and shadow.stats.skipped["preempted"] == 2
    assert not shadow.run_piece()
    assert sum(shadow.stats.checks.values()) == 0


def test_a_sample_arriving_when_the_shadow_used_its_share_is_skipped(engine_for):
    engine = engine_for("llama")
    shadow = Shadow(engine.ops, ShadowConfig(fraction=1.0, max_share=1e-9))
    shadow.submit(finished_sample(engine), busy=False)
    while shadow.run_piece():
        pass
    assert sum(shadow.stats.checks.values()) == 1 and shadow.stats.seconds > 0
    shadow.submit(finished_sample(engine), busy=False)
    assert shadow.stats.skipped["budget"] == 1 and shadow.pending == 0


def test_sampling_takes_the_configured_fraction_of_eligible_requests(engine_for):
    engine = engine_for("llama")
    shadow = Shadow(engine.ops, ShadowConfig(fraction=0.25), rng=random.Random(7))
    taken = [shadow.sample(Mode.CACHEBLEND, (1, 2), True, False) for _ in range(2000)]
    assert 0.22 < sum(s is not None for s in taken) / len(taken) < 0.28
    assert shadow.sample(Mode.CACHEBLEND, (1, 2), True, fell_back=True) is None
    off = Shadow(engine.ops, ShadowConfig())
    assert all(off.sample(Mode.FULL_REUSE, (1,), True, False) is None for _ in range(100))


def test_checks_are_skipped_while_their_kv_would_pass_the_budget(engine_for):
    engine = engine_for("llama")
    sample = finished_sample(engine)
    shape, itemsize = engine.ops.shape, engine.ops.dtype.itemsize
    per_position = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize
    # The host copy of the blend's prompt KV, and full prefill's KV of prompt + answer - 1.
    one_check = per_position * (2 * len(sample.prompt) + 2 - 1)
    config = ShadowConfig(fraction=1.0, max_share=1.0, max_tokens=2, max_kv_bytes=one_check)
    shadow = Shadow(engine.ops, config)
    shadow.submit(sample, busy=False)
    assert shadow.kv_bytes == one_check and sample.kv is not None
    assert sample.kv[0].device.type == "cpu"
    shadow.submit(finished_sample(engine), busy=False)
    assert shadow.stats.skipped["memory"] == 1 and shadow.pending == 1
    while shadow.run_piece():
        pass
    assert sum(shadow.stats.checks.values()) == 1 and shadow.kv_bytes == 0
    shadow.submit(finished_sample(engine), busy=False)  # room again
    assert shadow.pending == 1 and shadow.stats.skipped["memory"] == 1


def test_a_check_of_an_exact_kv_deviates_nowhere_and_one_of_naive_reuse_does(engine_for):
    engine = engine_for("llama")
    layout = engine.layout(GenerateRequest("q", chunks=long_chunks(3, 12)))
    engine.precompute(long_chunks(3, 12))
    reports: list[ShadowReport] = []
    shadow = Shadow(engine.ops, ShadowConfig(fraction=1.0, max_share=1.0, max_tokens=6))
    shadow.add_listener(reports.append)
    for mode in (Mode.FULL_PREFILL, Mode.FULL_REUSE):
        output = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode))).output
        kv = (output.keys.clone(), output.values.clone())
        sample = ShadowSample(Mode.FULL_REUSE, layout.token_ids, False, 6, kv)
        sample.observe(output.logits, 0)
        shadow.submit(sample, busy=False)
        while shadow.run_piece():
            pass
    exact, naive = reports
    assert exact.answer_tokens == naive.answer_tokens == 6
    assert exact.answer_kl < 1e-9 and exact.answer_argmax_agreement == 1.0
    # Position 0 of the answer is the first token, whose KL is one term of the mean: the
    # positions fed after the blend's prompt KV deviate too.
    later_kl = naive.answer_kl * naive.answer_tokens - naive.kl_divergence
    assert later_kl > 1e-4, (naive.answer_kl, naive.kl_divergence)
