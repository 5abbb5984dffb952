"""The speed rule and the overlap measure, as pure functions; the controller's estimates learnt
from measurements, device work counting once the device is done."""

from __future__ import annotations

import pytest
import torch

from engine.blend.controller import Controller
from engine.blend.ratio import SpeedDecision, speed_rule
from engine.blend.timeline import intersection, merge, overlap_fraction
from kvstore import tiers
from kvstore.device_time import DeviceSpan, mark


def test_fast_loads_keep_the_minimum_ratio_and_leading_layers():
    decision = speed_rule(
        layer_compute_s=1.0, layer_load_s=0.05, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.recompute_ratio == 0.15 and decision.leading_layers == 1
    assert not decision.full_prefill


def test_loads_hidden_by_recompute_raise_the_ratio_to_load_over_compute():
    decision = speed_rule(
        layer_compute_s=1.0, layer_load_s=0.4, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.recompute_ratio == pytest.approx(0.4)
    assert not decision.full_prefill


def test_loads_nearly_as_slow_as_compute_fall_back_too():
    for load in (0.8, 0.9, 0.99):
        decision = speed_rule(
            layer_compute_s=1.0,
            layer_load_s=load,
            num_layers=32,
            min_ratio=0.15,
            min_leading_layers=1,
        )
        assert decision.full_prefill, load
    assert not speed_rule(1.0, 0.79, 32, 0.15, 1).full_prefill


def test_loads_slower_than_compute_fall_back_to_full_prefill():
    decision = speed_rule(
        layer_compute_s=1.0, layer_load_s=1.3, num_layers=32, min_ratio=0.15, min_leading_layers=1
    )
    assert decision.full_prefill and decision.recompute_ratio == 1.0


def test_blending_per_layer_cost_never_exceeds_full_compute():
    for load in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0, 2.0):
        d = speed_rule(1.0, load, 32, 0.15, 1)
        per_layer = 1.0 if d.full_prefill else max(load, d.recompute_ratio * 1.0)
        assert per_layer <= 1.0


def test_controller_learns_load_and_compute_speeds_from_measurements():
    controller = Controller()
    assert controller.seconds_per_byte[tiers.SSD] == 1 / tiers.PRIOR_BYTES_PER_S[tiers.SSD]
    controller.observe_compute(num_tokens=1000, seconds=1.0)  # 1 ms per token-layer
    controller.observe_load({tiers.SSD: 10**9}, seconds=2.0)  # 0.5 GB/s replaces the prior
    slow = decide(controller, 1000, {tiers.SSD: 3 * 10**8})  # 0.6 s load vs 1 s
    assert slow.recompute_ratio == pytest.approx(0.6, rel=0.05)
    fast = decide(controller, 1000, {tiers.MEMORY: 4 * 10**8})
    assert fast.recompute_ratio == 0.15


MB = 10**6


def decide(controller: Controller, num_tokens: int, layer_bytes: dict[str, int]) -> SpeedDecision:
    """The speed rule over the controller's estimates, for 8 layers at a floor of 0.15."""
    layer = controller.estimate(num_tokens, layer_bytes)
    return speed_rule(layer.compute_s, layer.load_s, 8, 0.15, 1)


def measured(layer_load_s: float) -> Controller:
    """A controller that measured one layer of 1 MB loading from memory in `layer_load_s`,
    against 1 s of compute per layer of 1000 tokens."""
    controller = Controller()
    controller.observe_compute(num_tokens=1000, seconds=1.0)
    controller.observe_load({tiers.MEMORY: MB}, seconds=layer_load_s)
    return controller


def layer_load_s(controller: Controller) -> float:
    return decide(controller, 1000, {tiers.MEMORY: MB}).layer_load_s


def test_one_read_2000x_slower_moves_the_estimate_and_one_fast_read_does_not_erase_it():
    controller = measured(0.01)
    controller.observe_load({tiers.MEMORY: MB}, seconds=20.0)  # 2000x slower
    assert layer_load_s(controller) == pytest.approx(20.0)
    assert decide(controller, 1000, {tiers.MEMORY: MB}).full_prefill
    # A fast read of a blending request (not a probe) is averaged, not taken as it is.
    # Averaging bytes per second instead, the slow read would have moved the estimate by 43%.
    controller.observe_load({tiers.MEMORY: MB}, seconds=0.01)
    assert layer_load_s(controller) == pytest.approx(0.7 * 20.0 + 0.3 * 0.01)
    assert decide(controller, 1000, {tiers.MEMORY: MB}).full_prefill


def test_a_read_100x_slower_flips_the_next_decision_even_from_a_small_load_ratio():
    controller = measured(0.02)  # loads take 2% of the compute
    controller.observe_load({tiers.MEMORY: MB}, seconds=2.0)  # 100x: twice the compute
    decision = decide(controller, 1000, {tiers.MEMORY: MB})
    assert decision.full_prefill and decision.layer_load_s == pytest.approx(2.0)


def test_a_probe_read_in_fallback_replaces_the_estimate_so_the_next_request_blends():
    controller = measured(5.0)
    assert decide(controller, 1000, {tiers.MEMORY: MB}).full_prefill
    controller.observe_load({tiers.MEMORY: MB}, seconds=0.01, probe=True)
    decision = decide(controller, 1000, {tiers.MEMORY: MB})
    assert not decision.full_prefill and decision.recompute_ratio == 0.15
    assert decision.layer_load_s == pytest.approx(0.01)


def test_a_mixed_stream_charges_its_slowest_tier_with_the_time_the_others_leave():
    controller = measured(0.01)  # memory: 1e-8 s per byte
    controller.observe_load({tiers.MEMORY: MB, tiers.SSD: 2 * MB}, seconds=1.01)
    assert controller.seconds_per_byte[tiers.SSD] == pytest.approx(1.0 / (2 * MB))
    assert controller.seconds_per_byte[tiers.MEMORY] == pytest.approx(0.01 / MB)
    # Memory's estimate leaves nothing over: the slowest gets at least its share by bytes.
    controller.observe_load({tiers.MEMORY: MB, tiers.SSD: MB}, seconds=0.002, probe=True)
    assert controller.seconds_per_byte[tiers.SSD] == pytest.approx(0.001 / MB)


def test_a_tier_never_heard_of_counts_as_the_slowest_known():
    controller = Controller()
    slowest = max(1 / bps for bps in tiers.PRIOR_BYTES_PER_S.values())
    assert controller.estimate(0, {"tape": 10}).load_s == 10 * slowest


def test_overlap_is_the_fraction_of_load_time_under_compute():
    loads = [(0.0, 1.0), (1.0, 2.0)]
    computes = [(0.5, 1.5)]
    assert overlap_fraction(loads, computes) == pytest.approx(0.5)
    assert overlap_fraction([], computes) == 1.0
    assert merge([(2, 3), (0, 1), (0.5, 2.5)]) == [(0, 3)]
    assert intersection([(0, 10)], [(1, 2), (3, 4)]) == pytest.approx(2.0)


def test_a_measurement_counts_once_its_device_work_is_done():
    controller = Controller()
    done: list[float] = []
    controller.observe_compute(num_tokens=1000, seconds=lambda: done[0] if done else None)
    controller.observe_load({tiers.MEMORY: MB}, seconds=lambda: done[1] if done else None)
    assert controller.token_layer_s is None  # the device has not reached the end mark yet
    before = decide(controller, 1000, {tiers.MEMORY: MB})
    done.extend([1.0, 0.5])  # the events completed: 1 ms per token-layer, 0.5 s per MB
    after = decide(controller, 1000, {tiers.MEMORY: MB})
    assert controller.token_layer_s == pytest.approx(1e-3)
    assert before.layer_compute_s == 0.0 and after.layer_compute_s == pytest.approx(1.0)
    assert after.recompute_ratio == pytest.approx(0.5)


def test_a_cpu_span_measures_the_host_clock_and_is_never_pending():
    span = DeviceSpan(mark(torch.device("cpu")), mark(torch.device("cpu")))
    seconds = span.seconds()
    assert seconds is not None and seconds >= 0.0
