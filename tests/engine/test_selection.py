"""The pure selection functions of the blend."""

from __future__ import annotations

from typing import get_args

import torch

from engine.api.settings import EngineSettings
from engine.selection import (
    Selection,
    prompt_generator,
    ratio_schedule,
    select_random,
    select_top,
    selection_budget,
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
    annotation = EngineSettings.model_fields["selection"].annotation
    assert set(get_args(annotation)) == {s.value for s in Selection}
