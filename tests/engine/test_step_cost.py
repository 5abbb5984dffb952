"""The step cost probe measures a row's dense work and how many keys its attention reads for
the same price, on the engine's own model; an engine takes a given cost instead of measuring."""

from __future__ import annotations

import math

from engine.engine import Engine
from engine.step_cost import PROBE_KEYS, StepCost, measure_step_cost


def test_the_probe_measures_a_positive_finite_cost(engine_for):
    cost = measure_step_cost(engine_for("llama").ops)
    assert 0.0 < cost.seconds_per_token < 1.0
    assert 1.0 <= cost.keys_per_token < math.inf


def test_a_sliding_window_bounds_the_probe_keys(engine_for):
    ops = engine_for("mistral").ops
    assert ops.windows[0] is not None and ops.windows[0] < PROBE_KEYS
    assert measure_step_cost(ops).keys_per_token < math.inf


def test_an_engine_counts_with_the_cost_it_is_given(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), step_cost=StepCost(250.0, 0.002))
    try:
        assert engine.executor.budget.keys_per_token == 250.0
        assert engine.executor.budget.seconds_per_token == 0.002
    finally:
        engine.close()
