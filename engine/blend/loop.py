"""The CacheBlend prefill: one layer loop that fuses cached chunk KV with selective recompute.

Layer i's chunk KV is asked of the stream only when layer i starts, so a loader can overlap
reading layer i+1 with the compute of layer i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.blend.budget import StepBudget, wait
from engine.blend.check import check_keeps, check_scores
from engine.blend.dense import Dense, Pausable
from engine.blend.plan import PrefillPlan
from engine.blend.prompt_kv import DenseKV, KVOut, PromptKV, device_index
from engine.blend.selection import Selection, prompt_generator
from engine.model.attention import AttentionPlan
from engine.model.layers import LayerOps
from engine.model.logprobs import Logprobs, logprobs_of
from kvstore.device_time import DeviceSpan, mark
from kvstore.types import ChunkKV, LayerStream


@dataclass
class LayerCompute:
    """One layer of a prefill: when it ran on the host's clock (the timeline), the span of its
    work where it ran (`device`: CUDA events on a GPU), the tokens it computed, and whether
    that span timed this prefill's work alone (no pause, no other prefill or decode rows in
    its forward): only such layers teach the controller."""

    layer: int
    compute_start_s: float
    compute_end_s: float
    num_tokens: int  # tokens computed in this layer
    paused_s: float = 0.0  # of start..end, the time paused between pieces (other work ran)
    device: DeviceSpan | None = None
    alone: bool = True

    @property
    def busy_s(self) -> float:
        return self.compute_end_s - self.compute_start_s - self.paused_s


@dataclass
class PrefillOutput:
    kv: PromptKV  # the prompt's KV, post-RoPE at the final positions
    logits: torch.Tensor  # [vocab], float32, of the last position
    num_selected: int  # blended chunk tokens recomputed through the last layer
    kv_wait_s: float
    layer_computes: list[LayerCompute] = field(default_factory=list)
    pre_rope_keys: torch.Tensor | None = None  # [L, H_kv, T, D] when the plan asks for them
    # Of prompt tokens 1..T-1 (each predicted by the positions before it), when the plan asks.
    prompt_logprobs: Logprobs | None = None

    @property
    def keys(self) -> torch.Tensor:
        """[L, H_kv, T, D] of a prefill into a buffer of its own (DenseKV)."""
        assert isinstance(self.kv, DenseKV), "a prefill into the pool's blocks has no buffer"
        return self.kv.keys

    @property
    def values(self) -> torch.Tensor:
        assert isinstance(self.kv, DenseKV), "a prefill into the pool's blocks has no buffer"
        return self.kv.values


def layer_loop(
    ops: LayerOps,
    plan: PrefillPlan,
    prefix_kv: ChunkKV | None = None,
    stream: LayerStream | None = None,
    out: KVOut = None,
    budget: StepBudget | None = None,
) -> Pausable[PrefillOutput]:
    """Execute `plan`: the KV cache of the whole prompt plus the last logits.

    `prefix_kv` is required when `plan.prefix_cached`; `stream` must deliver, per layer, the
    KV of `plan.streamed_chunks` in that order. `out` receives the prompt's KV: a PromptKV
    (the sequence's blocks), or (keys, values) [L, H_kv, T, D]; without it a buffer is
    allocated. A layer's rows are computed in pieces while `budget` lasts (None: no bound),
    and the loop pauses (yields) between pieces when it is spent. A check layer projects its rows
    in pieces too, then checks every candidate at once, then attends in pieces.
    Pieces give the same result as the whole layer: each row's attention reads the keys of
    the rows before it, which earlier pieces (or the cache) wrote. Drive it with
    engine.blend.dense's `advance` or `run_to_end` (they run each resumption in inference mode).

    Per layer the loop runs a fixed number of batched operations, whatever the number of
    chunks: the streamed chunks' KV is one tensor pair (LayerKV), rotated to its positions in
    one operation and written in one; the only read-back is a check layer's selection."""
    assert plan.prefix_cached == (prefix_kv is not None)
    assert prefix_kv is None or prefix_kv.rotated, (
        "a prefix's keys are used where they were rotated"
    )
    if budget is None:
        budget = StepBudget()
    device, shape = ops.device, ops.shape
    num_tokens, num_layers = plan.num_tokens, shape.num_layers
    cos, sin = ops.rope_tables(num_tokens)
    kv = _target(ops, num_tokens, out)
    pre_rope = (
        torch.empty((num_layers, *kv.layer(0)[0].shape), dtype=ops.dtype, device=device)
        if plan.keep_pre_rope_keys
        else None
    )

    # Which positions each layer computes is tracked on the host: the attention plan is built
    # there, and reading a mask back from the device would wait for every queued kernel.
    blend_positions = plan.blend_positions
    blend_row = {p: row for row, p in enumerate(blend_positions)}
    blending = plan.recompute_ratio > 0 and bool(blend_row)
    checks = sorted(set(plan.check_layers)) if blending else []
    # The random baseline draws from the tokens still selected, so narrowing stays nested.
    random_pick = blending and plan.selection is Selection.RANDOM and plan.token_scores is None
    generator = prompt_generator(plan.token_ids) if random_pick else None

    # The streamed chunks' positions (every blended token, in order: the rows of a LayerKV),
    # with their RoPE tables gathered once for every layer.
    streamed = _Rows(blend_positions, device, (cos, sin)) if plan.streamed_chunks else None

    positions = sorted(plan.always_computed_positions + (blend_positions if blending else []))
    computed = _Computed(ops, positions, cos, sin, covers_blended=blending)
    h = ops.embed(device_index(plan.token_ids, device)[computed.rows.index])

    first_needed = plan.first_streamed_layer
    kv_wait_s, layer_computes = 0.0, []
    for i in range(num_layers):
        yield from wait(budget)
        wait_start = time.perf_counter()
        cached = stream.layer(i) if stream is not None and i >= first_needed else None
        compute_start = time.perf_counter()
        kv_wait_s += compute_start - wait_start
        start_mark, alone = mark(device), budget.alone

        k_layer, v_layer = kv.layer(i)
        if prefix_kv is not None:
            k_layer[:, : plan.prefix_len] = prefix_kv.keys[i]
            v_layer[:, : plan.prefix_len] = prefix_kv.values[i]
        if cached is not None and streamed is not None and not computed.covers_blended:
            # Every blended token's cached KV, rotated to its position in this prompt; the
            # tokens this layer computes overwrite theirs.
            streamed.write(k_layer, ops.rotate(cached.keys, streamed.cos, streamed.sin))
            streamed.write(v_layer, cached.values)

        num_computed = h.shape[0]
        if i in checks:
            assert cached is not None, "a check layer reads the blended chunks' cached KV"
            # The check compares every candidate: it waits until the layer projected all its
            # rows (in pieces), then runs at once.
            (q, k, v), paused = yield from _project_all(
                ops, i, h, (k_layer, v_layer), pre_rope, computed, budget
            )
            candidates = [j for j, p in enumerate(positions) if p in blend_row]
            layer = (q, k, v, k_layer)
            scores = check_scores(
                ops, i, plan, positions, candidates, layer, cached, generator, blend_row
            )
            check = checks.index(i)
            chosen = check_keeps(plan, scores, check, len(checks), blend_row, positions)
            if chosen is not None:
                # The one read-back of a check layer: which tokens were selected.
                dropped = set(candidates) - {candidates[c] for c in chosen.tolist()}
                keep = [j for j in range(len(positions)) if j not in dropped]
                kept = device_index(keep, device)
                h, q = h[kept], q[:, kept]
                positions = [positions[j] for j in keep]
                covers = computed.covers_blended and not dropped
                computed = _Computed(ops, positions, cos, sin, covers_blended=covers)
            h, attend_paused = yield from _pieces(
                ops, i, h, (k_layer, v_layer), computed, budget, q
            )
            paused += attend_paused
        else:
            h, paused = yield from _pieces(
                ops, i, h, (k_layer, v_layer), computed, budget, None, pre_rope
            )
        kv.layer_done(i)
        span = DeviceSpan(start_mark, mark(device))
        layer_computes.append(
            LayerCompute(
                i,
                compute_start,
                time.perf_counter(),
                num_computed,
                paused,
                span,
                alone and budget.alone and not paused,
            )
        )

    assert positions[-1] == num_tokens - 1, "the last prompt position is always computed"
    prompt_logprobs = None
    if plan.prompt_logprobs is not None:
        assert len(positions) == num_tokens, "prompt logprobs need every position computed"
        prompt_logprobs = _prompt_logprobs(ops, h, plan.token_ids, plan.prompt_logprobs)
    return PrefillOutput(
        kv=kv,
        logits=ops.logits(h[-1]),
        num_selected=sum(p in blend_row for p in positions) if blending else 0,
        kv_wait_s=kv_wait_s,
        layer_computes=layer_computes,
        pre_rope_keys=pre_rope,
        prompt_logprobs=prompt_logprobs,
    )


# Positions whose logits [rows, V] exist at once: a long prompt's would not fit ([T, V] float32
# is 1.6 GB for 8k positions of a 49k vocabulary).
PROMPT_LOGITS_ROWS = 256


def _prompt_logprobs(
    ops: LayerOps, h: torch.Tensor, token_ids: tuple[int, ...], top_n: int
) -> Logprobs:
    """Of tokens 1..T-1 of the prompt, from the last layer's states h [T, hidden]: position p
    predicts token p + 1."""
    states, rows = h[:-1], PROMPT_LOGITS_ROWS
    parts = [
        logprobs_of(
            ops.logits_batch(states[start : start + rows]),
            token_ids[start + 1 : start + 1 + rows],
            top_n,
        )
        for start in range(0, len(states), rows)
    ]
    return Logprobs.concat(parts)


def _target(ops: LayerOps, num_tokens: int, out: KVOut) -> PromptKV:
    """Where the prompt's KV goes: `out`, the caller's tensors, or a buffer of its own."""
    if isinstance(out, tuple):
        return DenseKV.over(*out)
    if out is not None:
        assert out.num_tokens == num_tokens, (out.num_tokens, num_tokens)
        return out
    shape = ops.shape
    return DenseKV(
        shape.num_layers, shape.num_kv_heads, num_tokens, shape.head_dim, ops.dtype, ops.device
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
) -> Pausable[tuple[torch.Tensor, float]]:
    """Layer i over the computed rows, piece by piece in position order, each attending over
    every key up to its last position; its output and the seconds paused between pieces.
    Without `q` (a check layer projected every row already) a piece first projects its rows
    and writes their KV."""
    outputs, start, paused = [], 0, 0.0
    while start < h.shape[0]:
        paused += yield from wait(budget)
        end = start + budget.piece(h.shape[0] - start)
        part = computed if end - start == h.shape[0] else computed.part(ops, start, end)
        if q is None:
            q_part = (yield from _project(ops, i, h[start:end], cache, pre_rope, part))[0]
        else:
            q_part = q[:, start:end]
        attn_out = ops.attend(i, q_part, *cache, part.attention)
        outputs.append((yield Dense(ops, i, h[start:end], attn_out)))
        budget.spend(end - start)
        start = end
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), paused


class _Rows:
    """Sorted, unique positions of a prompt, their RoPE tables (cos, sin [n, D], gathered
    once), and how to write their rows into a cache [H_kv, T, D] in one operation: a slice
    when they are one contiguous run, else an indexed copy."""

    def __init__(
        self, positions: list[int], device: torch.device, tables: tuple[torch.Tensor, torch.Tensor]
    ):
        self.positions = positions
        self.index = device_index(positions, device)
        self.cos, self.sin = tables[0][self.index], tables[1][self.index]
        contiguous = bool(positions) and positions[-1] - positions[0] + 1 == len(positions)
        self.run = (positions[0], positions[-1] + 1) if contiguous else None

    def write(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """cache[:, positions] = rows, for rows [H_kv, n, D]."""
        if self.run is not None:
            cache[:, self.run[0] : self.run[1]] = rows
        else:
            cache.index_copy_(1, self.index, rows)


class _Computed:
    """The positions a layer computes, with what follows from them until a check layer narrows
    them: RoPE tables, the attention plan, whether they hold every blended token, and how to
    write their KV."""

    def __init__(
        self,
        ops: LayerOps,
        positions: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        covers_blended: bool = False,
    ):
        self.positions, self._tables = positions, (cos, sin)
        self.rows = _Rows(positions, cos.device, (cos, sin))
        self.cos, self.sin = self.rows.cos, self.rows.sin
        self.attention: AttentionPlan = ops.attention_plan(positions)
        # Every blended token is among the positions (before a check narrows them): the
        # layer computes them all, so no cached KV is written.
        self.covers_blended = covers_blended

    def part(self, ops: LayerOps, start: int, end: int) -> _Computed:
        """Rows start..end-1 alone: one piece of a layer."""
        return _Computed(ops, self.positions[start:end], *self._tables)

    def write(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """cache[:, positions] = rows, for a cache [H_kv, T, D] and rows [H_kv, n, D]."""
        self.rows.write(cache, rows)
