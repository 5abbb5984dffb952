"""A prefill split into pieces under a small step budget gives the KV and logits of the same
prefill run whole, in every mode and on every family; it pauses as often as the budget says."""

from __future__ import annotations

import math
import time

import pytest
import torch

from demo.tiny import FAMILIES
from engine.budget import MIN_PIECE_ROWS, StepBudget, advance
from engine.prefill import Prefill
from engine.types import GenerateRequest, Mode

RTOL, ATOL = 1e-4, 1e-5  # float32 rounding: pieces are matmuls of other shapes


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, max_tokens=4, **overrides)


def split(
    engine, req: GenerateRequest, per_step: int, keys_per_token: float = math.inf
) -> tuple[Prefill, int]:
    """The prefill driven one step at a time with `per_step` token-layers; its pauses."""
    budget = StepBudget(per_step, keys_per_token)
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
    whole = engine.prefill(req)
    pieces, pauses = split(engine, req, MIN_PIECE_ROWS)
    assert pauses >= engine.ops.shape.num_layers - 1  # at least between every two layers
    assert_same(pieces, whole)
    assert pieces.blend == whole.blend


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [Mode.FULL_PREFILL, Mode.CACHEBLEND])
def test_a_prefill_split_by_attention_cost_equals_the_whole_one(
    engine_for, make_chunks, family, mode
):
    engine = engine_for(family, (1, 2))
    chunks = make_chunks(4, seed=8)
    engine.precompute(chunks)
    req = request(chunks, mode=mode, recompute_ratio=0.3 if mode is Mode.CACHEBLEND else None)
    unweighted = split(engine, req, 4 * MIN_PIECE_ROWS)
    weighted = split(engine, req, 4 * MIN_PIECE_ROWS, keys_per_token=8)
    assert weighted[1] > unweighted[1]  # rows that attend over more keys fill a step sooner
    assert_same(weighted[0], engine.prefill(req))


def test_a_row_costs_one_token_plus_its_keys_over_keys_per_token():
    budget = StepBudget(left=100, keys_per_token=10)
    row_cost = [1 + (p + 1) / 10 for p in range(200)]
    end, cost = budget.piece(list(range(200)), 0)
    assert cost == pytest.approx(sum(row_cost[:end]))
    assert cost <= 100 < cost + row_cost[end]  # as many rows as the budget pays for
    assert end > MIN_PIECE_ROWS
    late = list(range(1000, 1100))
    end, cost = budget.piece(late, 0)
    assert end == MIN_PIECE_ROWS  # each costs > 100: the least a piece computes
    assert cost == pytest.approx(sum(1 + (p + 1) / 10 for p in late[:MIN_PIECE_ROWS]))
    windowed = budget.piece(late, 0, window=10)
    assert windowed == (50, 100.0)  # a sliding window caps the keys each row reads at 10


def test_a_step_ends_when_its_time_allowance_is_spent():
    budget = StepBudget(seconds_per_token=1.0)
    budget.refill(100)  # 100 s of work: the count rules
    assert not budget.spent
    assert budget.piece(list(range(50)), 0)[0] == 50
    budget.refill(0.02)
    time.sleep(0.05)
    assert budget.spent and budget.left > 0  # the time ran out before the count
    assert budget.piece(list(range(50)), 0)[0] == MIN_PIECE_ROWS


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
