"""What a check layer of the blend keeps: its candidates' scores, computed when a selection asks
for them, and the budget (fixed, or the auto ratio's) of the tokens recomputed from there on."""

from __future__ import annotations

import bisect
import functools

import torch

from engine.blend.plan import PrefillPlan
from engine.blend.prompt_kv import device_index
from engine.blend.ratio import tokens_kept
from engine.blend.selection import (
    CheckScores,
    Selection,
    query_attention,
    select,
    select_top,
    token_deviation,
)
from engine.model.layers import LayerOps
from kvstore.types import LayerKV


def check_scores(
    ops: LayerOps,
    index: int,
    plan: PrefillPlan,
    positions: list[int],
    candidates: list[int],
    layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cached: LayerKV,
    generator: torch.Generator | None,
    blend_row: dict[int, int],
) -> CheckScores:
    """The scores of a check layer's candidates (indices into `positions`), each computed
    when a selection first asks: `layer` holds the computed tokens' rotated q, pre-RoPE k and
    v, and the layer's whole key cache; `cached` the streamed (blended) chunks' cached KV,
    whose rows are `plan.blend_positions`; `blend_row` maps a blended position to its row."""
    q, k, v, k_layer = layer
    device = k.device
    chosen_positions = [positions[j] for j in candidates]

    def deviation() -> torch.Tensor:
        rows = device_index([blend_row[p] for p in chosen_positions], device)
        picked = device_index(candidates, device)
        return token_deviation(
            k[:, picked], cached.keys[:, rows], v[:, picked], cached.values[:, rows]
        )

    def attention() -> torch.Tensor:
        suffix = list(range(plan.suffix_start, plan.num_tokens))
        if not suffix:
            return torch.zeros(len(candidates), device=device)
        first = positions.index(plan.suffix_start)
        paid = query_attention(q[:, first:], k_layer, suffix, ops.attention_scale(index))
        return paid[device_index(chosen_positions, device)]

    # Every candidate is a blended chunk token: its chunk is the last one starting at or before it.
    starts = [start for start, _ in plan.chunk_spans]
    offsets = [p - starts[bisect.bisect_right(starts, p) - 1] for p in chosen_positions]
    # Cached: the auto ratio's mass and the pick may ask for the same score.
    return CheckScores(functools.cache(deviation), functools.cache(attention), offsets, generator)


def check_keeps(
    plan: PrefillPlan,
    scores: CheckScores,
    check: int,
    num_checks: int,
    blend_row: dict[int, int],
    positions: list[int],
) -> torch.Tensor | None:
    """The candidates check layer `check` (of `num_checks`) keeps (indices into them), or None
    to keep them all: as many as `tokens_kept` says, ranked by the plan's selection (by
    caller-given `plan.token_scores`, an oracle's, where given)."""
    n = len(scores.offsets)
    selection = plan.selection if check == num_checks - 1 else early(plan.selection)
    budget = tokens_kept(
        plan, check, num_checks, len(blend_row), lambda: auto_mass(selection, scores)
    )
    if plan.token_scores is not None:
        if budget >= n:
            return None
        rows = [blend_row[p] for p in positions if p in blend_row]
        ranked = torch.tensor([plan.token_scores[row] for row in rows])
        return select_top(ranked, budget)
    # A budget that keeps every candidate selects them all without a score (the random
    # baseline still draws, so its generator stays where later checks expect).
    if budget >= n and scores.generator is None:
        return None
    return select(selection, scores, budget)


def early(selection: Selection) -> Selection:
    """How a check layer before the last narrows: the question's attention is read at the last
    one only (the deepest, where it is the most telling), the earlier ones narrow by deviation."""
    if selection in (Selection.QUERY, Selection.QUERY_HKVD, Selection.WEIGHTED):
        return Selection.HKVD
    return selection


def auto_mass(selection: Selection, scores: CheckScores) -> torch.Tensor:
    """What the auto ratio covers a share of: the question's attention for the selections
    that rank by it, the KV deviation for the others."""
    if selection in (Selection.QUERY, Selection.QUERY_HKVD):
        return scores.attention()
    if selection is Selection.WEIGHTED:
        return scores.deviation() * scores.attention()
    return scores.deviation()


def default_selection(check_layers: tuple[int, ...]) -> Selection:
    """`query_hkvd` when the last check layer is deeper than the first (it reads the question's
    attention there), else `hkvd`: at one early layer attention is mostly positional, and
    picking by it did worse than HKVD alone (docs/quality.md, "Token selection")."""
    return Selection.QUERY_HKVD if max(check_layers) > min(check_layers) else Selection.HKVD


def default_check_layers(num_layers: int) -> tuple[int, ...]:
    """Layer 1, then a quarter of the depth: the first check narrows by KV deviation, the last
    reads the question's attention where it is telling (docs/quality.md, "Token selection":
    layers 1 and 7 of SmolLM2's 30). Below 8 layers, layer 1 alone (layer 0 on one layer)."""
    deep = num_layers // 4
    return (1, deep) if deep > 1 else (min(1, num_layers - 1),)
