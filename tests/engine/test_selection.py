"""The pure selection functions of the blend."""

from __future__ import annotations

import torch

from engine.selection import ratio_schedule, select_top, selection_budget, token_deviation


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
