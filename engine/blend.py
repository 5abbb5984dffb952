"""The CacheBlend prefill: one layer loop that fuses cached chunk KV with selective recompute.

Layer i's chunk KV is asked of the stream only when layer i starts, so a loader can overlap
reading layer i+1 with the compute of layer i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionPlan
from engine.budget import StepBudget, wait
from engine.check import check_keeps, check_scores, indices
from engine.dense import Dense, Pausable, run_to_end
from engine.layers import LayerOps
from engine.plan import PrefillPlan
from engine.selection import Selection, prompt_generator, ratio_schedule
from kvstore.types import ChunkKV, LayerStream


@dataclass
class LayerCompute:
    layer: int
    compute_start_s: float
    compute_end_s: float
    num_tokens: int  # tokens computed in this layer
    paused_s: float = 0.0  # of start..end, the time paused between pieces (other work ran)

    @property
    def busy_s(self) -> float:
        return self.compute_end_s - self.compute_start_s - self.paused_s


@dataclass
class PrefillOutput:
    keys: torch.Tensor  # [L, H_kv, T, D], post-RoPE at the final positions
    values: torch.Tensor  # [L, H_kv, T, D]
    logits: torch.Tensor  # [vocab], float32, of the last position
    num_selected: int  # blended chunk tokens recomputed through the last layer
    kv_wait_s: float
    layer_computes: list[LayerCompute] = field(default_factory=list)
    pre_rope_keys: torch.Tensor | None = None  # [L, H_kv, T, D] when the plan asks for them


def run_prefill(
    ops: LayerOps,
    plan: PrefillPlan,
    prefix_kv: ChunkKV | None = None,
    stream: LayerStream | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PrefillOutput:
    """Execute `plan` whole and return the KV cache of the whole prompt plus the last logits.

    `prefix_kv` is required when `plan.prefix_cached`; `stream` must deliver, per layer, the
    KV of `plan.streamed_chunks` in that order. `out` (keys, values) [L, H_kv, T, D] receives
    the prompt's KV; without it the KV is allocated.
    """
    return run_to_end(prefill_steps(ops, plan, prefix_kv, stream, out, StepBudget()))


def prefill_steps(
    ops: LayerOps,
    plan: PrefillPlan,
    prefix_kv: ChunkKV | None,
    stream: LayerStream | None,
    out: tuple[torch.Tensor, torch.Tensor] | None,
    budget: StepBudget,
) -> Pausable[PrefillOutput]:
    """`run_prefill` in pieces: a layer's rows are computed in pieces while `budget` lasts, and
    the loop pauses (yields) between pieces when it is spent. A check layer projects its rows
    in pieces too, then checks every candidate at once, then attends in pieces.
    Pieces give the same result as the whole layer: each row's attention reads the keys of
    the rows before it, which earlier pieces (or the cache) wrote. Drive it with
    engine.budget's `advance` or `run_to_end` (they run each resumption in inference mode)."""
    assert plan.prefix_cached == (prefix_kv is not None)
    assert prefix_kv is None or prefix_kv.rotated, (
        "a prefix's keys are used where they were rotated"
    )
    device, shape = ops.device, ops.shape
    num_tokens, num_layers = plan.num_tokens, shape.num_layers
    cos, sin = ops.rope_tables(num_tokens)
    cache_shape = (num_layers, shape.num_kv_heads, num_tokens, shape.head_dim)
    if out is None:
        keys = torch.empty(cache_shape, dtype=ops.dtype, device=device)
        values = torch.empty(cache_shape, dtype=ops.dtype, device=device)
    else:
        keys, values = out
        assert keys.shape == values.shape == cache_shape, (keys.shape, cache_shape)
    pre_rope = torch.empty_like(keys) if plan.keep_pre_rope_keys else None

    streamed_spans = [plan.chunk_spans[j] for j in plan.streamed_chunks]
    # Which positions each layer computes is tracked on the host: the attention plan is built
    # there, and reading a mask back from the device would wait for every queued kernel.
    blend_row = {p: row for row, p in enumerate(plan.blend_positions)}
    blending = plan.recompute_ratio > 0 and bool(blend_row)
    checks = sorted(set(plan.check_layers)) if blending else []
    ratios = dict(zip(checks, ratio_schedule(plan.recompute_ratio, len(checks)), strict=True))
    # The random baseline draws from the tokens still selected, so narrowing stays nested.
    random_pick = blending and plan.selection is Selection.RANDOM and plan.token_scores is None
    generator = prompt_generator(plan.token_ids) if random_pick else None

    positions = sorted(plan.always_computed_positions + (plan.blend_positions if blending else []))
    computed = _Computed(ops, positions, cos, sin, streamed_spans)
    num_first = len(positions)
    h = ops.embed(torch.tensor(plan.token_ids, device=device)[computed.active])

    first_needed = plan.first_streamed_layer
    kv_wait_s, layer_computes = 0.0, []
    for i in range(num_layers):
        yield from wait(budget)
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
            k_layer[:, start:end] = ops.rotate(k_cached, cos[start:end], sin[start:end])
            v_layer[:, start:end] = v_cached

        num_computed = h.shape[0]
        if i in ratios:
            # The check compares every candidate: it waits until the layer projected all its
            # rows (in pieces), then runs at once.
            (q, k, v), paused = yield from _project_all(
                ops, i, h, (k_layer, v_layer), pre_rope, computed, budget
            )
            candidates = [j for j, p in enumerate(positions) if p in blend_row]
            layer = (q, k, v, k_layer)
            scores = check_scores(
                ops, i, plan, positions, candidates, layer, streamed, generator, blend_row
            )
            chosen = check_keeps(plan, scores, ratios[i], i == checks[-1], blend_row, positions)
            if chosen is not None:
                # The one read-back of a check layer: which tokens were selected.
                dropped = set(candidates) - {candidates[c] for c in chosen.tolist()}
                keep = [j for j in range(len(positions)) if j not in dropped]
                kept = indices(keep, device)
                h, q = h[kept], q[:, kept]
                positions = [positions[j] for j in keep]
                computed = _Computed(ops, positions, cos, sin, streamed_spans)
            h, attend_paused = yield from _pieces(
                ops, i, h, (k_layer, v_layer), computed, budget, q
            )
            paused += attend_paused
        else:
            # A layer over every token this prefill computes (none dropped by a check yet)
            # paces the step budget's time allowance.
            every_row = len(positions) == num_first
            h, paused = yield from _pieces(
                ops, i, h, (k_layer, v_layer), computed, budget, None, pre_rope, every_row
            )
        layer_computes.append(
            LayerCompute(i, compute_start, time.perf_counter(), num_computed, paused)
        )

    assert positions[-1] == num_tokens - 1, "the last prompt position is always computed"
    return PrefillOutput(
        keys=keys,
        values=values,
        logits=ops.logits(h[-1]),
        num_selected=sum(p in blend_row for p in positions) if blending else 0,
        kv_wait_s=kv_wait_s,
        layer_computes=layer_computes,
        pre_rope_keys=pre_rope,
    )


def _project(
    ops: LayerOps,
    i: int,
    h: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    pre_rope: torch.Tensor | None,
    rows: _Computed,
) -> Pausable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """q (rotated), k and v (pre-RoPE) of `rows` at layer i, their KV written to the cache (the
    projections are dense work, handed out)."""
    k_layer, v_layer = cache
    q, k, v = yield Dense(ops, i, h)
    if pre_rope is not None:
        rows.write(pre_rope[i], k)
    rows.write(k_layer, ops.rotate(k, rows.cos, rows.sin))
    rows.write(v_layer, v)
    return ops.rotate(q, rows.cos, rows.sin), k, v


def _project_all(
    ops: LayerOps,
    i: int,
    h: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    pre_rope: torch.Tensor | None,
    computed: _Computed,
    budget: StepBudget,
) -> Pausable[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], float]]:
    """`_project` of every computed row at layer i, piece by piece while `budget` lasts (a
    projected row costs one token-layer); q, k, v of all rows and the seconds paused."""
    parts, start, paused, num_rows = [], 0, 0.0, h.shape[0]
    while start < num_rows:
        paused += yield from wait(budget)
        end = start + budget.piece(num_rows - start)
        part = computed if end - start == num_rows else computed.part(ops, start, end)
        parts.append((yield from _project(ops, i, h[start:end], cache, pre_rope, part)))
        budget.spend(end - start)
        start = end
    if len(parts) == 1:
        return parts[0], paused
    q, k, v = (torch.cat(rows, dim=1) for rows in zip(*parts, strict=True))
    return (q, k, v), paused


def _pieces(
    ops: LayerOps,
    i: int,
    h: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    computed: _Computed,
    budget: StepBudget,
    q: torch.Tensor | None = None,
    pre_rope: torch.Tensor | None = None,
    every_row: bool = False,
) -> Pausable[tuple[torch.Tensor, float]]:
    """Layer i over the computed rows, piece by piece in position order, each attending over
    every key up to its last position; its output and the seconds paused between pieces.
    Without `q` (a check layer projected every row already) a piece first projects its rows
    and writes their KV. `every_row`: the rows are every prompt token; each piece's time
    teaches the budget its pace."""
    outputs, start, paused = [], 0, 0.0
    while start < h.shape[0]:
        paused += yield from wait(budget)
        piece_start = time.perf_counter()
        end = start + budget.piece(h.shape[0] - start)
        part = computed if end - start == h.shape[0] else computed.part(ops, start, end)
        if q is None:
            q_part = (yield from _project(ops, i, h[start:end], cache, pre_rope, part))[0]
        else:
            q_part = q[:, start:end]
        attn_out = ops.attend(i, q_part, *cache, part.attention)
        outputs.append((yield Dense(ops, i, h[start:end], attn_out)))
        budget.observe(end - start, time.perf_counter() - piece_start, every_row)
        budget.spend(end - start)
        start = end
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), paused


# Beyond this many contiguous runs, the computed positions' KV is written by one indexed copy.
_MAX_SLICED_RUNS = 16


class _Computed:
    """The positions a layer computes, with what follows from them until a check layer narrows
    them: RoPE tables, the attention plan, the streamed chunks they cover whole, and how to
    write their KV (slices for a few contiguous runs, else one indexed copy)."""

    def __init__(
        self,
        ops: LayerOps,
        positions: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        streamed_spans: list[tuple[int, int]],
    ):
        self.positions, self._tables = positions, (cos, sin)
        self.active = active = indices(positions, cos.device)
        self.cos, self.sin = cos[active], sin[active]
        self.attention: AttentionPlan = ops.attention_plan(positions)
        starts = [
            i for i in range(len(positions)) if i == 0 or positions[i] != positions[i - 1] + 1
        ]
        self.runs = [
            (s, e, positions[s]) for s, e in zip(starts, [*starts[1:], len(positions)], strict=True)
        ]
        flags = bytearray(int(cos.shape[0]))
        for p in positions:
            flags[p] = 1
        self.covers_chunk = [all(flags[s : s + n]) for s, n in streamed_spans]

    def part(self, ops: LayerOps, start: int, end: int) -> _Computed:
        """Rows start..end-1 alone: one piece of a layer."""
        return _Computed(ops, self.positions[start:end], *self._tables, [])

    def write(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """cache[:, active] = rows, for a cache [H_kv, T, D] and rows [H_kv, n, D]."""
        if len(self.runs) > _MAX_SLICED_RUNS:
            cache.index_copy_(1, self.active, rows)
            return
        for start, end, position in self.runs:
            cache[:, position : position + end - start] = rows[:, start:end]
