"""How many tokens each check layer keeps, from the one rule: its share of the ratio as a count,
or under the auto ratio what covers the selection's mass, between the floor and that count."""

from __future__ import annotations

import pytest
import torch

from engine.blend.plan import ChunkSource, PrefillPlan
from engine.blend.ratio import tokens_kept


def plan(ratio: float, coverage: float | None = None, min_ratio: float = 0.0) -> PrefillPlan:
    return PrefillPlan(
        token_ids=tuple(range(101)),
        prefix_len=1,
        prefix_cached=False,
        chunk_spans=((1, 100),),
        chunk_sources=(ChunkSource.BLEND,),
        recompute_ratio=ratio,
        check_layers=(1, 4, 8),
        coverage=coverage,
        min_ratio=min_ratio,
    )


def no_mass() -> torch.Tensor:
    raise AssertionError("the mass is read under the auto ratio only")


def test_each_check_layer_keeps_its_share_of_the_ratio_narrowing_by_halves():
    kept = [tokens_kept(plan(0.1), check, 3, 100, no_mass) for check in range(3)]
    assert kept == [40, 20, 10]
    assert tokens_kept(plan(0.15), 0, 1, 101, no_mass) == 16  # the ceiling of 15.15


@pytest.mark.parametrize(("share", "expected"), [(0.5, 5), (0.99, 10), (0.01, 3)])
def test_the_auto_ratio_keeps_what_covers_the_mass_between_the_floor_and_the_bound(share, expected):
    # Ten tokens share the mass evenly, the other ninety have none.
    mass = torch.cat([torch.ones(10), torch.zeros(90)])
    auto = plan(0.5, coverage=share, min_ratio=0.03)
    assert tokens_kept(auto, 0, 1, 100, lambda: mass) == expected
