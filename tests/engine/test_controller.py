"""The controller's rule and the overlap measure, as pure functions."""

from __future__ import annotations

import pytest

from engine.controller import Controller, decide
from engine.timeline import intersection, merge, overlap_fraction


def test_fast_loads_keep_the_minimum_ratio_and_leading_layers():
    decision = decide(
        layer_compute_s=1.0, layer_load_s=0.05, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.recompute_ratio == 0.15 and decision.leading_layers == 1
    assert not decision.full_prefill


def test_loads_hidden_by_recompute_raise_the_ratio_to_load_over_compute():
    decision = decide(
        layer_compute_s=1.0, layer_load_s=0.4, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.recompute_ratio == pytest.approx(0.4)
    assert not decision.full_prefill


def test_loads_slower_than_compute_fall_back_to_full_prefill():
    decision = decide(
        layer_compute_s=1.0, layer_load_s=1.3, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.full_prefill and decision.recompute_ratio == 1.0


def test_blending_per_layer_cost_never_exceeds_full_compute():
    for load in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0, 2.0):
        d = decide(1.0, load, 32, 0.15, 1)
        per_layer = 1.0 if d.full_prefill else max(load, d.recompute_ratio * 1.0)
        assert per_layer <= 1.0


def test_controller_learns_bandwidth_and_compute_from_measurements():
    controller = Controller(min_ratio=0.15)
    controller.observe_compute(num_tokens=1000, seconds=1.0)  # 1 ms per token-layer
    controller.observe_load("ssd", num_bytes=10**9, seconds=2.0)  # 0.5 GB/s
    slow = controller.decide(1000, {"ssd": 4 * 10**8}, num_layers=8)  # 0.8 s load vs 1 s
    assert slow.recompute_ratio == pytest.approx(0.8, rel=0.05)
    fast = controller.decide(1000, {"memory": 4 * 10**8}, num_layers=8)
    assert fast.recompute_ratio == 0.15


def test_overlap_is_the_fraction_of_load_time_under_compute():
    loads = [(0.0, 1.0), (1.0, 2.0)]
    computes = [(0.5, 1.5)]
    assert overlap_fraction(loads, computes) == pytest.approx(0.5)
    assert overlap_fraction([], computes) == 1.0
    assert merge([(2, 3), (0, 1), (0.5, 2.5)]) == [(0, 3)]
    assert intersection([(0, 10)], [(1, 2), (3, 4)]) == pytest.approx(2.0)
