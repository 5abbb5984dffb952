"""A decode row's attention over its KV blocks: per row over views of its runs of consecutive
blocks (the CPU), or batched over gathered blocks under a mask (elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Per row, the runs of its keys as slices of the flattened pool or its rows to gather
# (`row_reads`); or, batched, the block table [B, W] and a mask [B, 1, 1, T] per sliding
# window of the model (a DecodeStep's).
RowRead = list[slice] | torch.Tensor
Reads = list[RowRead] | tuple[torch.Tensor, dict[int | None, torch.Tensor]]

# The most runs of consecutive blocks a row reads as views (one SDPA each, merged); a row in
# more pieces is gathered. Two: a shared prompt prefix, then the sequence's own blocks, whose
# views cost what one run does while a gather copies the whole context (more runs are not
# measured; docs/benchmarks/serving.md, "Paged KV").
MAX_VIEW_RUNS = 2


def token_rows(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows of the pool flattened to [N * block_size, H_kv, D] that hold `positions`."""
    return table[positions // block_size] * block_size + positions % block_size


def row_reads(
    tables: list[list[int]],
    positions: list[int],
    block_size: int,
    max_view_runs: int,
    device: torch.device,
) -> list[RowRead]:
    """Where the keys 0..positions[b] of each row lie in the pool flattened to
    [N * block_size, H_kv, D]: a slice per run of consecutive block ids, read as views (no
    copy; admission reserves a sequence's own blocks at once, so most rows are one run, or
    two behind a shared prefix), else, past `max_view_runs` runs, the rows to gather."""
    size = block_size
    reads: list[RowRead] = []
    for table, position in zip(tables, positions, strict=True):
        n = position + 1
        used = table[: -(-n // size)]
        starts = [0] + [j for j in range(1, len(used)) if used[j] != used[j - 1] + 1]
        if len(starts) <= max_view_runs:
            ends = [*starts[1:], len(used)]
            reads.append(
                [
                    slice(used[a] * size, used[a] * size + min(b * size, n) - a * size)
                    for a, b in zip(starts, ends, strict=True)
                ]
            )
        else:
            index = torch.tensor(used, device=device)
            reads.append(token_rows(index, torch.arange(n, device=device), size))
    return reads


def attend_rows(
    q_rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    reads: list[RowRead],
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of queries [B, H_kv, G, D], one SDPA per row over exactly its own keys of a
    layer's pool flattened to [N * block_size, H_kv, D] (no mask, no padding); [B, H_kv, G, D].
    On the CPU this beats one batched SDPA over gathered blocks, whose copy of every row's
    context slows the step the more, the longer the context (docs/benchmarks/serving.md,
    "Paged KV")."""
    outs = []
    for q, read in zip(q_rows[:, None], reads, strict=True):
        if isinstance(read, torch.Tensor):
            # [1, H_kv, n, D]: 4-D inputs take SDPA's fused CPU kernel, 3-D ones do not.
            k, v = keys[read].transpose(0, 1)[None], values[read].transpose(0, 1)[None]
            if window is not None:
                k, v = k[:, :, -window:], v[:, :, -window:]
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0])
        else:
            outs.append(_attend_runs(q, keys, values, _last(read, window), scale)[0])
    return torch.stack(outs)


def attend_batched(
    q_rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of queries [B, H_kv, G, D] as one SDPA over the gathered blocks of every row
    of `table` [B, W] in a layer's pool [N, block_size, H_kv, D], each row masked to its own
    positions (and sliding window): one launch per layer, for devices where launches, not
    copies, bound a decode step (CUDA: not measured against the slot view)."""
    k, v = gather_blocks(keys, table), gather_blocks(values, table)
    return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask, scale=scale)


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, W * block_size, D]: a layer's blocks [N, block_size, H_kv, D] of each row of
    `table` [B, W], as one copy and a transposed view (what SDPA reads)."""
    return pool[table].flatten(1, 2).transpose(1, 2)


def _last(runs: list[slice], count: int | None) -> list[slice]:
    """The runs trimmed to their last `count` positions (a sliding window; None: all)."""
    if count is None:
        return runs
    kept = []
    for run in reversed(runs):
        take = min(count, run.stop - run.start)
        kept.append(slice(run.stop - take, run.stop))
        count -= take
        if count == 0:
            break
    return kept[::-1]


def _attend_runs(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: list[slice], scale: float
) -> torch.Tensor:
    """Attention of q [1, H_kv, G, D] over the keys and values [T, H_kv, D] of `runs`, read as
    views: one SDPA per run, merged by their log-sum-exps (float32), so that no run is copied.
    The kernel is the fused CPU one F.scaled_dot_product_attention calls, which also returns
    the log-sum-exp."""
    if len(runs) == 1:
        k, v = keys[runs[0]].transpose(0, 1)[None], values[runs[0]].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    outs, lses = [], []
    for run in runs:
        k, v = keys[run].transpose(0, 1)[None], values[run].transpose(0, 1)[None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, scale=scale
        )[:2]
        outs.append(out)
        lses.append(lse)
    lse = torch.stack(lses)  # [R, 1, H_kv, G]
    weights = torch.exp(lse - torch.logsumexp(lse, 0))[..., None]
    return (weights * torch.stack(outs).float()).sum(0).to(q.dtype)
