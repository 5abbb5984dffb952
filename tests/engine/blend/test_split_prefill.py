"""A prefill split into pieces under a small step budget gives the KV and logits of the same
prefill run whole, in every mode and on every family; it pauses as often as the budget's count
says."""

from __future__ import annotations

import math

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.budget import MIN_PIECE_ROWS, StepBudget
from engine.blend.dense import advance
from engine.blend.prefill import Prefill, PrefillAsk
from engine.types import GenerateRequest, Mode

RTOL, ATOL = 1e-4, 1e-5  # float32 rounding: pieces are matmuls of other shapes


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, max_tokens=4, **overrides)


def split(engine, req: GenerateRequest, per_step: int) -> tuple[Prefill, int]:
    """The prefill driven one step at a time with `per_step` token-layers; its pauses."""
    budget = StepBudget(per_step)
    steps = engine.prefiller.prefill(engine.layout(req), PrefillAsk.of(req), budget)
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


def test_a_budget_pieces_a_layer_by_its_count_and_never_below_the_minimum_piece():
    budget = StepBudget()
    assert budget.piece(5000) == 5000  # unbounded: the whole layer
    budget.refill(100)
    assert budget.piece(50) == 50 and budget.piece(500) == 100
    budget.spend(95)
    assert not budget.spent and budget.piece(500) == MIN_PIECE_ROWS  # may overshoot
    budget.spend(16)
    assert budget.spent and budget.used == 111


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
        steps = engine.prefiller.prefill(engine.layout(req), PrefillAsk.of(req), budget)
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
    steps = engine.prefiller.prefill(engine.layout(req), PrefillAsk.of(req), StepBudget())
    done, prefill = advance(steps)
    assert done and prefill is not None
    assert_same(prefill, engine.prefill(req))
