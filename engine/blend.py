"""The CacheBlend prefill: one layer loop that fuses cached chunk KV with selective recompute.

Layer i's chunk KV is asked of the stream only when layer i starts, so a loader can overlap
reading layer i+1 with the compute of layer i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionPlan
from engine.layers import LayerRunner
from engine.plan import ChunkSource, PrefillPlan
from engine.selection import (
    Selection,
    prompt_generator,
    ratio_schedule,
    select_random,
    select_top,
    selection_budget,
    token_deviation,
)
from kvstore.types import LayerStream


@dataclass
class PrefixKV:
    """Exact post-RoPE KV of a prompt prefix at positions 0..P-1: [L, H_kv, P, D] each."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class LayerCompute:
    layer: int
    compute_start_s: float
    compute_end_s: float
    num_tokens: int  # tokens computed in this layer


@dataclass
class PrefillOutput:
    keys: torch.Tensor  # [L, H_kv, T, D], post-RoPE at the final positions
    values: torch.Tensor  # [L, H_kv, T, D]
    logits: torch.Tensor  # [vocab], float32, of the last position
    num_selected: int  # blended chunk tokens recomputed through the last layer
    kv_wait_s: float
    layer_computes: list[LayerCompute] = field(default_factory=list)
    pre_rope_keys: torch.Tensor | None = None  # [L, H_kv, T, D] when the plan asks for them


@torch.inference_mode()
def run_prefill(
    runner: LayerRunner,
    plan: PrefillPlan,
    prefix_kv: PrefixKV | None = None,
    stream: LayerStream | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PrefillOutput:
    """Execute `plan` and return the KV cache of the whole prompt plus the last logits.

    `prefix_kv` is required when `plan.prefix_cached`; `stream` must deliver, per layer, the
    KV of `plan.streamed_chunks` in that order. `out` (keys, values) [L, H_kv, T, D] receives
    the prompt's KV (a KV-pool slot); without it the KV is allocated.
    """
    assert plan.prefix_cached == (prefix_kv is not None)
    device, shape = runner.device, runner.shape
    num_tokens, num_layers = plan.num_tokens, shape.num_layers
    cos, sin = runner.rope_tables(num_tokens)
    cache_shape = (num_layers, shape.num_kv_heads, num_tokens, shape.head_dim)
    if out is None:
        keys = torch.empty(cache_shape, dtype=runner.dtype, device=device)
        values = torch.empty(cache_shape, dtype=runner.dtype, device=device)
    else:
        keys, values = out
        assert keys.shape == values.shape == cache_shape, (keys.shape, cache_shape)
    pre_rope = torch.empty_like(keys) if plan.keep_pre_rope_keys else None

    streamed_spans = [plan.chunk_spans[j] for j in plan.streamed_chunks]
    blend_slots = [
        slot
        for slot, j in enumerate(plan.streamed_chunks)
        if plan.chunk_sources[j] is ChunkSource.BLEND
    ]
    blend_positions = torch.tensor(plan.blend_positions, dtype=torch.long, device=device)
    blending = plan.recompute_ratio > 0 and blend_positions.numel() > 0
    checks = sorted(set(plan.check_layers)) if blending else []
    ratios = dict(zip(checks, ratio_schedule(plan.recompute_ratio, len(checks)), strict=True))
    # The random baseline draws from the tokens still selected, so narrowing stays nested.
    random_pick = blending and plan.selection is Selection.RANDOM
    generator = prompt_generator(plan.token_ids) if random_pick else None

    active = torch.tensor(plan.always_computed_positions, dtype=torch.long, device=device)
    if blending:
        active = torch.cat([active, blend_positions]).sort().values
    is_blend = torch.isin(active, blend_positions)
    computed = _Computed(runner, active, cos, sin, streamed_spans)
    h = runner.embed(torch.tensor(plan.token_ids, device=device)[active])

    first_needed = plan.first_streamed_layer
    kv_wait_s, layer_computes = 0.0, []
    for i in range(num_layers):
        wait_start = time.perf_counter()
        streamed = stream.layer(i) if stream is not None and i >= first_needed else []
        compute_start = time.perf_counter()
        kv_wait_s += compute_start - wait_start

        k_layer, v_layer = keys[i], values[i]
        if prefix_kv is not None:
            k_layer[:, : plan.prefix_len] = prefix_kv.keys[i]
            v_layer[:, : plan.prefix_len] = prefix_kv.values[i]
        for slot, (k_cached, v_cached) in enumerate(streamed):
            if computed.covers_chunk[slot]:
                continue  # every token of the chunk is computed in this layer: nothing reused
            start, length = streamed_spans[slot]
            end = start + length
            k_layer[:, start:end] = runner.rotate(k_cached, cos[start:end], sin[start:end])
            v_layer[:, start:end] = v_cached

        num_computed = h.shape[0]
        q, k, v = runner.project_qkv(i, h)
        if pre_rope is not None:
            computed.write(pre_rope[i], k)
        q = runner.rotate(q, computed.cos, computed.sin)
        computed.write(k_layer, runner.rotate(k, computed.cos, computed.sin))
        computed.write(v_layer, v)

        budget = selection_budget(ratios[i], blend_positions.numel()) if i in ratios else None
        # Counted at check layers only: on CUDA, int() waits for the device.
        num_candidates = int(is_blend.sum()) if budget is not None else 0
        # A budget that keeps every candidate selects them all: HKVD needs no deviation then
        # (the random baseline still draws, so its generator stays where later checks expect).
        if budget is not None and (budget < num_candidates or generator is not None):
            if generator is not None:
                chosen = select_random(num_candidates, budget, generator).to(device)
            else:
                cached_k = torch.cat([streamed[s][0] for s in blend_slots], dim=1)
                cached_v = torch.cat([streamed[s][1] for s in blend_slots], dim=1)
                rows = torch.searchsorted(blend_positions, active[is_blend])
                deviation = token_deviation(
                    k[:, is_blend], cached_k[:, rows], v[:, is_blend], cached_v[:, rows]
                )
                chosen = select_top(deviation, budget)
            keep = ~is_blend
            keep[is_blend.nonzero()[chosen, 0]] = True
            active, is_blend, h, q = active[keep], is_blend[keep], h[keep], q[:, keep]
            computed = _Computed(runner, active, cos, sin, streamed_spans)

        attn_out = runner.attend(i, q, k_layer, v_layer, computed.attention)
        h = runner.finish_layer(i, h, attn_out)
        layer_computes.append(LayerCompute(i, compute_start, time.perf_counter(), num_computed))

    assert int(active[-1]) == num_tokens - 1, "the last prompt position is always computed"
    return PrefillOutput(
        keys=keys,
        values=values,
        logits=runner.logits(h[-1]),
        num_selected=int(is_blend.sum()) if blending else 0,
        kv_wait_s=kv_wait_s,
        layer_computes=layer_computes,
        pre_rope_keys=pre_rope,
    )


# Beyond this many contiguous runs, the computed positions' KV is written by one indexed copy.
_MAX_SLICED_RUNS = 16


class _Computed:
    """The positions a layer computes, with what follows from them until a check layer narrows
    them: RoPE tables, the attention plan, the streamed chunks they cover whole, and how to
    write their KV (slices for a few contiguous runs, else one indexed copy)."""

    def __init__(
        self,
        runner: LayerRunner,
        active: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        streamed_spans: list[tuple[int, int]],
    ):
        positions = active.tolist()
        self.active = active
        self.cos, self.sin = cos[active], sin[active]
        self.attention: AttentionPlan = runner.attention_plan(positions)
        starts = [
            i for i in range(len(positions)) if i == 0 or positions[i] != positions[i - 1] + 1
        ]
        self.runs = [
            (s, e, positions[s]) for s, e in zip(starts, [*starts[1:], len(positions)], strict=True)
        ]
        flags = torch.zeros(int(cos.shape[0]), dtype=torch.bool)
        flags[active.cpu()] = True
        self.covers_chunk = [bool(flags[s : s + n].all()) for s, n in streamed_spans]

    def write(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """cache[:, active] = rows, for a cache [H_kv, T, D] and rows [H_kv, n, D]."""
        if len(self.runs) > _MAX_SLICED_RUNS:
            cache.index_copy_(1, self.active, rows)
            return
        for start, end, position in self.runs:
            cache[:, position : position + end - start] = rows[:, start:end]
