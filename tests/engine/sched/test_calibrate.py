"""The step token budget measured when an engine starts: within its bounds, and what the
engine's scheduler uses when no budget is set; a set budget is taken as it is."""

from __future__ import annotations

from engine.engine import Engine
from engine.sched.calibrate import MAX_STEP_TOKENS, step_token_budget
from engine.sched.scheduler import MIN_PREFILL_TOKENS


def test_an_engine_without_a_budget_measures_one_within_its_bounds(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"))
    try:
        budget = engine.scheduler.max_num_batched_tokens
        assert budget is not None and MIN_PREFILL_TOKENS <= budget <= MAX_STEP_TOKENS
        again = step_token_budget(engine.ops, engine.runner)  # the same machine, measured again
        assert MIN_PREFILL_TOKENS <= again <= MAX_STEP_TOKENS
    finally:
        engine.close()


def test_a_budget_that_is_set_is_not_measured(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), max_num_batched_tokens=77)
    try:
        assert engine.scheduler.max_num_batched_tokens == 77
    finally:
        engine.close()
