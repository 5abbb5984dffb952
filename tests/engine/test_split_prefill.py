"""A prefill split into pieces under a small step budget gives the KV and logits of the same
prefill run whole, in every mode and on every family; it pauses as often as the budget says."""

from __future__ import annotations

import math
import time

import pytest
import torch

from demo.tiny import FAMILIES
from engine.budget import MIN_LENT_ALLOWANCES, MIN_PIECE_ROWS, StepBudget
from engine.dense import advance
from engine.prefill import Prefill
from engine.types import GenerateRequest, Mode

RTOL, ATOL = 1e-4, 1e-5  # float32 rounding: pieces are matmuls of other shapes


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, max_tokens=4, **overrides)


def split(engine, req: GenerateRequest, per_step: int) -> tuple[Prefill, int]:
    """The prefill driven one step at a time with `per_step` token-layers; its pauses."""
    budget = StepBudget(per_step)
    steps = engine.prefiller.request_steps(engine.layout(req), req, budget)
    pauses = 0
    while True:
        done, prefill = advance(steps)
        if done:
            assert prefill is not None
            return prefill, pauses
        pauses += 1
        budget.left = per_step


def assert_same(a: Prefill, b: Prefill) -> None:
    torch.testing.assert_close(a.output.logits, b.output.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(a.output.keys, b.output.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(a.output.values, b.output.values, rtol=RTOL, atol=ATOL)
    assert a.output.num_selected == b.output.num_selected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "overrides",
    [
        {"mode": Mode.FULL_PREFILL},
        {"mode": Mode.CACHEBLEND, "recompute_ratio": 0.3},
        {"mode": Mode.CACHEBLEND, "recompute_ratio": "auto"},
        {"mode": Mode.FULL_REUSE},
        {"mode": Mode.PREFIX_CACHE},
    ],
    ids=["full_prefill", "cacheblend", "cacheblend-auto", "full_reuse", "prefix_cache"],
)
def test_a_split_prefill_equals_the_whole_one(engine_for, make_chunks, family, overrides):
    engine = engine_for(family, (1, 2))
    chunks = make_chunks(4, seed=7)
    engine.precompute(chunks)
    req = request(chunks, **overrides)
    # Both runs decide from the same measured speeds (the auto ratio's floor comes from them;
    # the first run's timings would move them).
    controller = engine.prefiller.controller
    speeds = controller.token_layer_s, dict(controller.seconds_per_byte)
    whole = engine.prefill(req)
    controller.token_layer_s, controller.seconds_per_byte = speeds[0], dict(speeds[1])
    pieces, pauses = split(engine, req, MIN_PIECE_ROWS)
    assert pauses >= engine.ops.shape.num_layers - 1  # at least between every two layers
    assert_same(pieces, whole)
    assert pieces.blend == whole.blend


def test_a_step_ends_when_its_time_allowance_is_spent():
    budget = StepBudget(seconds_per_token=1.0)
    budget.refill(100)  # 100 s of work: the count rules
    assert not budget.spent
    assert budget.piece(50) == 50
    budget.refill(0.02)
    time.sleep(0.05)
    assert budget.spent and budget.left > 0  # the time ran out before the count
    assert budget.piece(50) == MIN_PIECE_ROWS


def test_slack_short_of_the_lent_minimum_is_banked_and_longer_slack_is_lent():
    budget = StepBudget(seconds_per_token=1.0)
    budget.refill(10)  # an allowance of 10 s
    budget.lend(MIN_LENT_ALLOWANCES * 10 * 0.9)
    assert budget.spent  # banked: no prefill computes in the step
    budget.refill(10)
    budget.lend(MIN_LENT_ALLOWANCES * 10 * 1.5)
    assert math.isinf(budget.left) and budget.deadline_s - time.perf_counter() > 50
    budget.refill(10)
    budget.lend(1.0, bank=False)  # prompts that fit the count whole: the allowance stands
    assert budget.left == 10 and not budget.spent


def test_without_a_learnt_pace_slack_leaves_the_budget_to_the_count():
    budget = StepBudget()
    budget.refill(10)
    budget.lend(0.0)
    assert budget.left == 10 and not budget.spent


def test_the_budget_learns_its_pace_from_pieces_of_one_prefill_in_bounded_steps():
    budget = StepBudget()
    budget.observe(100, 1.0, every_row=True)  # an unbounded step: whole layers run faster per token
    assert budget.seconds_per_token == 0.0
    budget.refill(200)
    budget.observe(100, 1.0, every_row=True)
    assert budget.seconds_per_token == pytest.approx(0.01)
    budget.observe(20, 1.0, every_row=True)  # a small piece: its fixed costs weigh by its size only
    sums = (0.8 * 20 + 0.2 * 20, 0.8 * 0.2 + 0.2 * 1.0)  # running token-layers and seconds
    assert budget.seconds_per_token == pytest.approx(sums[1] / sums[0])
    pace = budget.seconds_per_token
    budget.shared = True  # side by side: a piece's time holds the others' work
    budget.observe(100, 9.0, every_row=True)
    assert budget.seconds_per_token == pace
    budget.shared = False
    budget.refill(100)
    assert budget.deadline_s - time.perf_counter() == pytest.approx(100 * pace, abs=0.1)
    budget.observe(10, 10 * 4 * pace)  # a blend's piece, 4x the pace: sized by it, not learnt
    assert budget.seconds_per_token == pace
    assert budget.piece(10_000) == pytest.approx(100 / 4, abs=2)


def test_a_blend_and_a_full_prefill_teach_the_budget_from_their_full_layers(
    engine_for, make_chunks
):
    engine = engine_for("llama", (1, 2))
    chunks = make_chunks(4, seed=10)
    engine.precompute(chunks)
    for mode in (Mode.FULL_PREFILL, Mode.CACHEBLEND):
        req = request(chunks, mode=mode, recompute_ratio=0.3 if mode is Mode.CACHEBLEND else None)
        budget = StepBudget()
        steps = engine.prefiller.request_steps(engine.layout(req), req, budget)
        done = False
        while not done:
            budget.refill(4 * MIN_PIECE_ROWS)
            done, _ = advance(steps)
        assert budget.seconds_per_token > 0.0, mode


def test_a_check_layer_projects_its_rows_in_pieces(engine_for, make_chunks):
    engine = engine_for("llama", (1, 2))
    chunks = make_chunks(4, seed=9)
    engine.precompute(chunks)
    req = request(chunks, mode=Mode.CACHEBLEND, recompute_ratio=0.3)
    per_step, projected = MIN_PIECE_ROWS, []
    ops = engine.ops
    project = ops.project_qkv

    def counted(index, h):
        projected[-1] += h.shape[0]
        return project(index, h)

    ops.project_qkv = counted
    try:
        budget = StepBudget(per_step)
        steps = engine.prefiller.request_steps(engine.layout(req), req, budget)
        done = False
        while not done:
            projected.append(0)
            done, _ = advance(steps)
            budget.left = per_step
    finally:
        del ops.project_qkv
    # At most one piece past the budget: no step projects a whole check layer's rows.
    assert max(projected) <= per_step + MIN_PIECE_ROWS
    assert engine.layout(req).num_tokens > 2 * (per_step + MIN_PIECE_ROWS)


def test_a_prefill_pauses_about_once_per_budget_of_token_layers(engine_for, make_chunks):
    engine = engine_for("llama")
    req = request(make_chunks(3, seed=3), mode=Mode.FULL_PREFILL)
    layers, tokens = engine.ops.shape.num_layers, engine.layout(req).num_tokens
    per_step = 3 * MIN_PIECE_ROWS
    _, pauses = split(engine, req, per_step)
    # Each step spends at least its budget, and at most one piece less than a layer's end.
    assert math.ceil(layers * tokens / per_step) - 1 >= pauses >= layers * tokens // (2 * per_step)


def test_an_unbounded_budget_runs_the_prefill_in_one_go(engine_for, make_chunks):
    engine = engine_for("llama")
    req = request(make_chunks(3, seed=4), mode=Mode.FULL_PREFILL)
    steps = engine.prefiller.request_steps(engine.layout(req), req, StepBudget())
    done, prefill = advance(steps)
    assert done and prefill is not None
    assert_same(prefill, engine.prefill(req))
