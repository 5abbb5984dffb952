"""Oracle token scores, research only: from a full prefill of the prompt and its answer, how much
each blended token's reused KV would deviate, and how much the question and answer attend to it.

They bound what a selection could reach (docs/quality.md); serving never computes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from engine.blend.selection import query_attention, token_deviation
from engine.model.layers import LayerOps
from kvstore.types import ChunkKV


class Oracle(StrEnum):
    DEVIATION = "deviation"  # true KV deviation summed over every layer
    ATTENTION = "attention"  # attention of question and answer summed over every layer
    WEIGHTED = "weighted"  # each layer's deviation weighted by that attention


@dataclass(frozen=True)
class OracleScores:
    """One score per blended token, in prompt order, for each Oracle."""

    by_oracle: dict[Oracle, tuple[float, ...]]


@torch.inference_mode()
def oracle_scores(
    ops: LayerOps,
    token_ids: Sequence[int],
    chunk_spans: Sequence[tuple[int, int]],
    cached: Sequence[ChunkKV],
    suffix_start: int,
) -> OracleScores:
    """Scores of the tokens of `chunk_spans` (blended from `cached`, pre-RoPE keys) in a prompt
    `token_ids` whose positions from `suffix_start` on are the question and, when the caller
    appends it, the answer: every layer run in full, as a full prefill does."""
    device = ops.device
    num_tokens = len(token_ids)
    cos, sin = ops.rope_tables(num_tokens)
    positions = list(range(num_tokens))
    plan = ops.attention_plan(positions)
    chunk_rows = torch.tensor(
        [p for start, n in chunk_spans for p in range(start, start + n)], device=device
    )
    suffix = positions[suffix_start:]
    deviation = torch.zeros(len(chunk_rows))
    attention = torch.zeros(len(chunk_rows))
    weighted = torch.zeros(len(chunk_rows))
    h = ops.embed(torch.tensor(list(token_ids), device=device))
    for i in range(ops.shape.num_layers):
        q, k, v = ops.project_qkv(i, h)
        cached_k = torch.cat([c.keys[i].to(device) for c in cached], dim=1)
        cached_v = torch.cat([c.values[i].to(device) for c in cached], dim=1)
        layer_deviation = token_deviation(
            k[:, chunk_rows], cached_k, v[:, chunk_rows], cached_v
        ).cpu()
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        paid = query_attention(q[:, suffix_start:], k, suffix, ops.attention_scale(i))
        layer_attention = paid[chunk_rows].cpu()
        deviation += layer_deviation
        attention += layer_attention
        weighted += layer_deviation * layer_attention
        h = ops.finish_layer(i, h, ops.attend(i, q, k, v, plan))
    return OracleScores(
        {
            Oracle.DEVIATION: tuple(deviation.tolist()),
            Oracle.ATTENTION: tuple(attention.tolist()),
            Oracle.WEIGHTED: tuple(weighted.tolist()),
        }
    )
