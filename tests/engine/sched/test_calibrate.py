"""The step token budget measured when an engine starts: within its bounds, a decoding
sequence's weight at least one prompt token, and what the engine's scheduler uses when no budget
is set; a set budget is taken as it is, a decode counting one token."""

from __future__ import annotations

from engine.engine import Engine
from engine.sched.calibrate import MAX_STEP_TOKENS, measure_step_budget
from engine.sched.scheduler import MIN_PREFILL_TOKENS


def test_an_engine_without_a_budget_measures_one_within_its_bounds(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"))
    try:
        budget = engine.scheduler.max_num_batched_tokens
        assert budget is not None and MIN_PREFILL_TOKENS <= budget <= MAX_STEP_TOKENS
        assert 1.0 <= engine.scheduler.decode_weight <= budget
        # The same machine, measured again.
        again = measure_step_budget(engine.ops, engine.runner, max_num_seqs=4)
        assert MIN_PREFILL_TOKENS <= again.tokens <= MAX_STEP_TOKENS
        assert 1.0 <= again.decode_weight <= again.tokens
        one = measure_step_budget(engine.ops, engine.runner, max_num_seqs=1)
        assert one.decode_weight == 1.0  # nothing to compare one decoding sequence with
    finally:
        engine.close()


def test_a_budget_that_is_set_is_not_measured(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), max_num_batched_tokens=77)
    try:
        assert engine.scheduler.max_num_batched_tokens == 77
        assert engine.scheduler.decode_weight == 1.0
    finally:
        engine.close()
