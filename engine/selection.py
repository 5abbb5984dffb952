"""Which chunk tokens to recompute: the deviation measure and top-k selection of CacheBlend.

Pure functions on ints and small tensors, tested on their own.
"""

from __future__ import annotations

import math

import torch


def ratio_schedule(ratio: float, num_checks: int) -> list[float]:
    """Selection ratio at each check layer: halved at each step, ending at `ratio` (paper §4.3).

    One check layer selects `ratio` at once; three select 4r, 2r, then r of the chunk tokens.
    """
    return [min(1.0, ratio * 2 ** (num_checks - 1 - step)) for step in range(num_checks)]


def selection_budget(ratio: float, num_tokens: int) -> int:
    """ceil(ratio * num_tokens), robust to float noise (0.15 * 100 selects 15, not 16)."""
    return min(num_tokens, math.ceil(round(ratio * num_tokens, 6)))


def token_deviation(
    keys: torch.Tensor, cached_keys: torch.Tensor, values: torch.Tensor, cached_values: torch.Tensor
) -> torch.Tensor:
    """Squared L2 distance per token over heads x head_dim, keys plus values.

    All inputs [H_kv, n, D]; keys must be compared at the same position (both pre-RoPE here).
    Returns [n] in float32.
    """
    dk = (keys.float() - cached_keys.float()).square().sum(dim=(0, 2))
    dv = (values.float() - cached_values.float()).square().sum(dim=(0, 2))
    return dk + dv


def select_top(deviation: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the `budget` largest deviations, in ascending index order."""
    if budget >= deviation.numel():
        return torch.arange(deviation.numel(), device=deviation.device)
    return torch.topk(deviation, budget, sorted=False).indices.sort().values
