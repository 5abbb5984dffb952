"""The queue-wait estimate of /health: plain arithmetic on counts and measured step speeds."""

from __future__ import annotations

import math

import pytest

from engine.sched.blocks import BlockManager
from engine.sched.estimate import QueueEstimate
from engine.sched.scheduler import MIN_PREFILL_TOKENS, Scheduler
from engine.sched.sequence import Sequence
from engine.types import StepRecord


def decode_step(seconds: float, batch: int = 4) -> StepRecord:
    return StepRecord(batch, seconds, 0, 0, 0.0)


def prefill_step(completed_tokens: int, seconds: float) -> StepRecord:
    return StepRecord(0, 0.0, 1, completed_tokens, seconds)


def measured(prefill_tokens_per_s: float = 1000.0, decode_step_s: float = 0.01) -> QueueEstimate:
    estimate = QueueEstimate()
    estimate.observe(prefill_step(int(prefill_tokens_per_s), 1.0))
    estimate.observe(decode_step(decode_step_s))
    return estimate


def test_an_idle_engine_has_no_wait():
    assert (
        measured().wait_s(
            waiting_tokens=0, waiting_max_tokens=[], running_remaining=[], startable=4
        )
        == 0.0
    )


def test_prompts_waiting_ahead_cost_their_prefill_and_the_decode_steps_between():
    wait = measured().wait_s(
        waiting_tokens=2000, waiting_max_tokens=[64, 64], running_remaining=[50], startable=3
    )
    # 2 s of prefill, then a decode step after each of the 2 prefills and after the newest.
    assert wait == pytest.approx(2.0 + 3 * 0.01)


def test_under_a_step_token_budget_the_prompts_ahead_share_one_step_per_piece_with_decodes():
    wait = measured().wait_s(
        waiting_tokens=2000,
        waiting_max_tokens=[64],
        in_flight=1,
        running_remaining=[50],
        startable=3,
        step_tokens=500,
    )
    # 2 s of prefill in 4 pieces of 500 tokens, each step with a decode, and one after them.
    assert wait == pytest.approx(2.0 + 5 * 0.01)


@pytest.mark.parametrize(
    ("decode_weight", "step_tokens"),
    [(1.0, 400 - 4), (25.0, 400 - 100), (200.0, MIN_PREFILL_TOKENS)],
)
def test_the_sequences_decoding_now_take_their_weight_of_each_steps_budget(
    decode_weight: float, step_tokens: float
):
    scheduler = Scheduler(BlockManager(256, 16), 8, 4, 4096, 400, decode_weight=decode_weight)
    decoding = [Sequence(num_prompt_tokens=10, max_tokens=50) for _ in range(4)]
    for x in decoding:
        scheduler.add(x)
    scheduler.schedule()
    for x in decoding:
        x.num_cached = x.num_prompt_tokens  # prefilled: they decode from the next step
    scheduler.add(Sequence(num_prompt_tokens=2000, max_tokens=64))
    scheduler.schedule()
    assert len(scheduler.decoding) == 4 and len(scheduler.prefilling) == 1
    estimate = measured()
    wait = estimate.wait_for(scheduler)
    # 2 s of prefill, then a decode step with each piece of what the decodes leave, and one after.
    assert wait == pytest.approx(2.0 + (math.ceil(2000 / step_tokens) + 1) * 0.01)


def test_a_prefill_in_pieces_counts_towards_throughput_once_it_completes():
    estimate = QueueEstimate()
    estimate.observe(StepRecord(2, 0.01, 1, 0, 0.5))
    assert estimate.prefill_tokens_per_s is None
    estimate.observe(StepRecord(2, 0.01, 1, 900, 0.25))
    assert estimate.prefill_tokens_per_s == pytest.approx(900 / 0.75)
    assert estimate.decode_step_s == pytest.approx(0.01)


def test_with_every_lane_taken_the_request_waits_for_a_running_sequence_to_end():
    wait = measured().wait_s(
        waiting_tokens=0, waiting_max_tokens=[], running_remaining=[300, 120], startable=0
    )
    assert wait == pytest.approx(120 * 0.01)


def test_sequences_waiting_ahead_hold_the_lanes_they_take_for_their_max_tokens():
    wait = measured().wait_s(
        waiting_tokens=0,
        waiting_max_tokens=[100, 40],
        running_remaining=[300, 120],
        startable=0,
    )
    # The first waiting sequence takes the lane freed at 120 and holds it to 220; the second
    # takes the one freed at 220 (before 300) and holds it to 260: the next lane frees at 260.
    assert wait == pytest.approx(260 * 0.01)


def test_a_free_lane_goes_to_the_first_waiting_sequence_and_frees_after_its_max_tokens():
    estimate = measured()
    wait = estimate.wait_s(
        waiting_tokens=0, waiting_max_tokens=[50], running_remaining=[80], startable=1
    )
    assert wait == pytest.approx(50 * 0.01)
    idle = estimate.wait_s(
        waiting_tokens=0, waiting_max_tokens=[], running_remaining=[], startable=0
    )
    assert idle == 0.0


def test_unmeasured_steps_count_as_free_and_averages_follow_new_speeds():
    estimate = QueueEstimate()
    assert (
        estimate.wait_s(
            waiting_tokens=500, waiting_max_tokens=[64], running_remaining=[10], startable=1
        )
        == 0.0
    )
    estimate.observe(decode_step(0.01, batch=1))
    for _ in range(50):
        estimate.observe(decode_step(0.05, batch=1))
    assert estimate.decode_step_s == pytest.approx(0.05, rel=1e-3)


def test_where_decodes_are_fused_into_the_prefills_forward_no_decode_step_is_added():
    estimate = measured()
    estimate.observe(StepRecord(2, 0.0, 1, 0, 0.1))  # a fused decode: its time in prefill_s
    assert estimate.decodes_fused
    wait = estimate.wait_s(
        waiting_tokens=2000,
        waiting_max_tokens=[64],
        in_flight=1,
        running_remaining=[50],
        startable=3,
        step_tokens=500,
    )
    assert wait == pytest.approx(2000 / estimate.prefill_tokens_per_s)  # type: ignore[operator]
    estimate.observe(StepRecord(2, 0.01, 1, 0, 0.1))  # decoded on its own (a CUDA graph)
    assert not estimate.decodes_fused


def test_a_full_queue_has_room_once_the_first_running_sequence_ends_at_the_latest():
    estimate = measured(decode_step_s=0.05)
    assert estimate.room_after_s([300, 40, 120]) == pytest.approx(40 * 0.05)
    assert estimate.room_after_s([]) == 0.0
    assert QueueEstimate().room_after_s([40]) == 0.0  # no decode step measured yet
