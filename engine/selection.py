"""Which chunk tokens to recompute: the deviation measure and top-k selection of CacheBlend,
and a seeded random pick of the same budget as a research baseline.

Pure functions on ints and small tensors, tested on their own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from enum import StrEnum

import torch


class Selection(StrEnum):
    """How the check layers pick the chunk tokens to recompute."""

    HKVD = "hkvd"  # the tokens whose KV deviates most from the cached KV (CacheBlend)
    RANDOM = "random"  # a seeded random pick of the same budget: a baseline for HKVD


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


def prompt_generator(token_ids: Sequence[int]) -> torch.Generator:
    """A CPU generator seeded from the prompt's tokens: the same prompt draws the same picks."""
    digest = hashlib.blake2b(
        b"".join(t.to_bytes(8, "little") for t in token_ids), digest_size=8
    ).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)  # seeds are below 2**63
    return generator


def select_random(num_tokens: int, budget: int, generator: torch.Generator) -> torch.Tensor:
    """`budget` distinct indices of 0..num_tokens-1 drawn uniformly, in ascending order."""
    if budget >= num_tokens:
        return torch.arange(num_tokens)
    return torch.randperm(num_tokens, generator=generator)[:budget].sort().values
