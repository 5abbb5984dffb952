"""The pacer: the prompt tokens a step's prefills may compute so that a step with decodes takes
a set multiple of a lone decode's measured time; unbounded until both speeds are measured."""

from __future__ import annotations

import math

import pytest

from engine.pacing import Pacer
from engine.scheduler import MIN_PREFILL_TOKENS, Step
from engine.types import StepRecord


def test_unmeasured_steps_leave_the_prefills_unpaced():
    pacer = Pacer(1.5, num_layers=12)
    assert math.isinf(pacer.tokens())
    pacer.observe(StepRecord(4, 0.03, 0, 0, 0.0))  # a decode alone: no prefill speed yet
    assert math.isinf(pacer.tokens())


def test_beside_a_lone_decode_the_prefill_tokens_take_the_ratio_times_its_time():
    pacer = Pacer(1.5, num_layers=12)
    # 0.03 s per decode; 1200 token-layers in 0.06 s = 50 us each, 600 us per token.
    pacer.observe(StepRecord(1, 0.03, 1, 0, 0.06, prefill_token_layers=1200))
    assert pacer.tokens() == pytest.approx(1.5 * 0.03 / (50e-6 * 12))


def test_a_larger_decode_batch_leaves_the_prefills_what_its_own_time_leaves():
    pacer = Pacer(2.0, num_layers=4)
    pacer.observe(StepRecord(1, 0.01, 1, 0, 0.01, prefill_token_layers=1000))
    for _ in range(50):  # the batch grows: a step decodes in 0.02 s, lone decodes in 0.01 s
        pacer.observe(StepRecord(8, 0.02, 0, 0, 0.0))
    # 3 lone decodes (0.03 s) less the batch's 0.02 s, at 10 us per token-layer, 4 layers.
    assert pacer.tokens() == pytest.approx(0.01 / (10e-6 * 4), rel=1e-3)
    for _ in range(50):
        pacer.observe(StepRecord(16, 0.05, 0, 0, 0.0))
    assert pacer.tokens() == pytest.approx(0.0, abs=1.0)  # nothing left: the floor applies


def test_a_step_keeps_to_the_lower_of_the_token_budget_and_the_paced_tokens():
    step: Step = Step(decodes=[object()] * 3, max_num_batched_tokens=256, paced_tokens=100.0)
    assert step.prefill_tokens == 100.0
    step.paced_tokens = 1000.0
    assert step.prefill_tokens == 256 - 3
    step.paced_tokens = 2.0
    assert step.prefill_tokens == MIN_PREFILL_TOKENS
    assert math.isinf(Step(max_num_batched_tokens=256, paced_tokens=100.0).prefill_tokens)


def test_a_ratio_must_be_positive():
    with pytest.raises(ValueError, match="prefill_decode_ratio"):
        Pacer(0.0, num_layers=2)
