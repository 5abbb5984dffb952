"""Which chunk tokens to recompute: the scores a check layer ranks them by (KV deviation, the
question's attention, position in the chunk) and the pick of each Selection (how many: ratio.py).

Pure functions on ints and small tensors, tested on their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.contract import Selection

__all__ = ["CheckScores", "Selection", "select"]


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


def query_attention(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: Sequence[int], scale: float
) -> torch.Tensor:
    """Attention the queries pay to each key, averaged over heads and queries: [T] float32.

    queries [H, s, D] at `query_positions` (rotated), keys [H_kv, T, D] (rotated); a query sees
    the keys at positions up to its own.
    """
    num_heads, num_kv_heads = queries.shape[0], keys.shape[0]
    expanded = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=0)
    logits = torch.einsum("hsd,htd->hst", queries.float(), expanded) * scale
    positions = torch.tensor(query_positions, device=keys.device)
    hidden = torch.arange(keys.shape[1], device=keys.device)[None, :] > positions[:, None]
    probs = logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
    return probs.mean(dim=(0, 1))


def sink_order(offsets: Sequence[int]) -> list[int]:
    """Candidates by their offset in their chunk, first tokens first, earlier chunks first on a
    tie: taking the first k of this order takes the first tokens of every chunk in turn."""
    return sorted(range(len(offsets)), key=lambda j: (offsets[j], j))


# SINK_HKVD's sink share: at most this many first tokens per chunk, and at most half the budget.
SINK_TOKENS = 4


@dataclass
class CheckScores:
    """What a check layer knows of its candidate tokens, each score computed on first use:
    `deviation` and `attention` return [n] tensors; `offsets` are positions in their chunk."""

    deviation: Callable[[], torch.Tensor]
    attention: Callable[[], torch.Tensor]
    offsets: Sequence[int]
    generator: torch.Generator | None = None


def select(selection: Selection, scores: CheckScores, budget: int) -> torch.Tensor:
    """The `budget` candidates `selection` recomputes, in ascending index order."""
    n = len(scores.offsets)
    if selection is Selection.RANDOM:
        assert scores.generator is not None, "the random pick draws from the prompt's generator"
        return select_random(n, budget, scores.generator)
    if budget >= n:
        return torch.arange(n)
    if selection is Selection.HKVD:
        return select_top(scores.deviation(), budget)
    if selection is Selection.QUERY:
        return select_top(scores.attention(), budget)
    if selection is Selection.WEIGHTED:
        return select_top(scores.deviation() * scores.attention(), budget)
    if selection is Selection.SINK:
        return torch.tensor(sorted(sink_order(scores.offsets)[:budget]), dtype=torch.long)
    if selection is Selection.SINK_HKVD:
        chunks = sum(1 for offset in scores.offsets if offset == 0)
        first = min(budget // 2, SINK_TOKENS * chunks)
        deviation = scores.deviation()
        fixed = torch.tensor(sink_order(scores.offsets)[:first], dtype=torch.long)
        return _complete(fixed.to(deviation.device, non_blocking=True), deviation, budget)
    if selection is Selection.QUERY_HKVD:
        fixed = select_top(scores.attention(), budget // 2)
        return _complete(fixed, scores.deviation(), budget)
    raise ValueError(f"unknown selection {selection!r}")


def _complete(fixed: torch.Tensor, ranking: torch.Tensor, budget: int) -> torch.Tensor:
    """`fixed` (distinct indices) plus the best of the others by `ranking`, `budget` in all,
    ascending; on the ranking's device, nothing read back."""
    if budget <= fixed.numel():
        return fixed.sort().values
    rest = ranking.float().clone()
    rest[fixed] = float("-inf")  # never picked again: the others outnumber what is asked
    extra = select_top(rest, budget - fixed.numel())
    return torch.cat([fixed, extra]).sort().values
