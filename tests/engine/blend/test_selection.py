"""The pure selection functions of the blend."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from engine.api.settings import EngineSettings
from engine.blend.ratio import coverage_budget, ratio_schedule, selection_budget
from engine.blend.selection import (
    SINK_TOKENS,
    CheckScores,
    Selection,
    prompt_generator,
    query_attention,
    select,
    select_random,
    select_top,
    sink_order,
    token_deviation,
)


def test_budget_is_the_ceiling_of_ratio_times_tokens():
    assert selection_budget(0.15, 100) == 15
    assert selection_budget(0.15, 101) == 16
    assert selection_budget(0.0, 50) == 0
    assert selection_budget(1.0, 50) == 50


def test_schedule_narrows_by_halves_to_the_final_ratio():
    assert ratio_schedule(0.15, 1) == [0.15]
    assert ratio_schedule(0.1, 3) == [0.4, 0.2, 0.1]
    assert ratio_schedule(0.5, 3) == [1.0, 1.0, 0.5]


def test_select_top_returns_the_largest_in_position_order():
    deviation = torch.tensor([0.1, 5.0, 0.2, 3.0, 4.0])
    assert select_top(deviation, 3).tolist() == [1, 3, 4]
    assert select_top(deviation, 9).tolist() == [0, 1, 2, 3, 4]


def test_deviation_is_squared_l2_over_heads_and_dims_of_keys_and_values():
    keys = torch.zeros(2, 3, 4)
    values = torch.zeros(2, 3, 4)
    moved = keys.clone()
    moved[1, 2, 0] = 2.0
    assert token_deviation(moved, keys, values + 1, values).tolist() == [8.0, 8.0, 12.0]


def test_random_pick_is_exactly_the_budget_of_distinct_indices_in_order():
    picked = select_random(40, 7, prompt_generator([5, 6, 7]))
    assert len(picked) == 7 == len(set(picked.tolist()))
    assert picked.tolist() == sorted(picked.tolist())
    assert int(picked.min()) >= 0 and int(picked.max()) < 40
    assert select_random(5, 9, prompt_generator([1])).tolist() == [0, 1, 2, 3, 4]
    assert select_random(5, 0, prompt_generator([1])).tolist() == []


def test_random_pick_is_seeded_by_the_prompt_tokens():
    prompt = list(range(100, 160))
    first = select_random(200, 10, prompt_generator(prompt)).tolist()
    assert select_random(200, 10, prompt_generator(prompt)).tolist() == first
    assert select_random(200, 10, prompt_generator([*prompt, 3])).tolist() != first


def test_random_pick_draws_uniformly_over_many_prompts():
    counts = [0] * 10
    for seed in range(2000):
        for index in select_random(10, 2, prompt_generator([seed])).tolist():
            counts[index] += 1
    # 4000 draws over 10 positions: 400 each expected, sd 19; a bias would show far beyond 100.
    assert max(counts) - min(counts) < 100


def test_engine_setting_offers_every_selection():
    annotation = EngineSettings.model_fields["selection"].annotation  # a Literal, or None
    offered = {value for arg in get_args(annotation) for value in get_args(arg)}
    assert offered == {s.value for s in Selection}


def scores_of(deviation, attention, offsets, seed=(1,)) -> CheckScores:
    return CheckScores(
        lambda: torch.tensor(deviation),
        lambda: torch.tensor(attention),
        offsets,
        prompt_generator(list(seed)),
    )


# Three chunks of 5, 4 and 3 tokens.
OFFSETS = [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
DEVIATION = [0.1, 0.2, 9.0, 0.3, 8.0, 0.4, 0.5, 7.0, 0.6, 0.7, 0.8, 0.9]
ATTENTION = [0.9, 0.0, 0.0, 0.8, 0.0, 0.0, 0.7, 0.0, 0.0, 0.0, 0.0, 0.6]


def test_every_selection_returns_exactly_its_budget_of_distinct_sorted_indices():
    for selection in Selection:
        for budget in (0, 1, 4, 7, 12, 20):
            picked = select(selection, scores_of(DEVIATION, ATTENTION, OFFSETS), budget).tolist()
            assert len(picked) == min(budget, 12), (selection, budget)
            assert picked == sorted(set(picked)), (selection, budget)
            assert all(0 <= j < 12 for j in picked)


def test_each_selection_ranks_by_its_own_score():
    scores = scores_of(DEVIATION, ATTENTION, OFFSETS)
    assert select(Selection.HKVD, scores, 3).tolist() == [2, 4, 7]
    assert select(Selection.QUERY, scores, 3).tolist() == [0, 3, 6]
    assert select(Selection.SINK, scores, 4).tolist() == [0, 1, 5, 9]
    # Half by attention (0 and 3), then the largest deviations of the others (2 and 4).
    assert select(Selection.QUERY_HKVD, scores, 4).tolist() == [0, 2, 3, 4]
    # Two sink tokens (half the budget), then the two largest deviations.
    assert select(Selection.SINK_HKVD, scores, 4).tolist() == [0, 2, 4, 5]
    # deviation x attention: 0.09, 0.24, 0.35, 0.54 are the only non-zero products.
    assert select(Selection.WEIGHTED, scores, 2).tolist() == [6, 11]


def test_sink_hkvd_takes_at_most_its_sink_tokens_per_chunk():
    offsets = list(range(40)) * 2  # two chunks of 40
    deviation = [float(j) for j in range(80)]
    picked = select(Selection.SINK_HKVD, scores_of(deviation, [0.0] * 80, offsets), 30).tolist()
    sinks = [j for j in picked if offsets[j] < SINK_TOKENS]
    assert len(sinks) == 2 * SINK_TOKENS
    assert picked[-22:] == list(range(58, 80))


def test_sink_order_takes_the_first_tokens_of_every_chunk_in_turn():
    assert sink_order([0, 1, 2, 0, 1, 0])[:4] == [0, 3, 5, 1]


def test_query_attention_is_the_mean_causal_softmax_over_heads_and_queries():
    torch.manual_seed(0)
    queries = torch.randn(4, 3, 8)  # 4 heads over 2 KV heads (GQA), 3 queries
    keys = torch.randn(2, 10, 8)
    positions = [7, 8, 9]
    paid = query_attention(queries, keys, positions, scale=0.5)
    expected = torch.zeros(10)
    for head in range(4):
        for row, position in enumerate(positions):
            logits = (keys[head // 2, : position + 1] @ queries[head, row]) * 0.5
            expected[: position + 1] += logits.softmax(0) / 12
    torch.testing.assert_close(paid, expected)
    assert float(paid.sum()) == pytest.approx(1.0)


def test_coverage_budget_counts_the_fewest_tokens_that_cover_the_share():
    mass = torch.tensor([5.0, 1.0, 3.0, 1.0])
    assert coverage_budget(mass, 0.5, 0, 4) == 1
    assert coverage_budget(mass, 0.8, 0, 4) == 2
    assert coverage_budget(mass, 1.0, 0, 4) == 4
    assert coverage_budget(mass, 1.0, 0, 3) == 3  # the bound
    assert coverage_budget(mass, 0.1, 2, 4) == 2  # the floor
    assert coverage_budget(torch.zeros(4), 0.5, 1, 4) == 1
