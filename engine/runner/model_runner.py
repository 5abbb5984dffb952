"""The model runner: a KV pool of fixed-size blocks sized once, and one batched decode step for
all running sequences that reads each one's blocks through its block table (engine/blocks.py).
"""

from __future__ import annotations

import math
import mmap
import os
from typing import cast, get_args

import torch

from engine.blend.dense import Dense, Pausable, run_to_end
from engine.model.layers import LayerOps
from engine.model.paged_attention import (
    MAX_VIEW_RUNS,
    Reads,
    RowRead,
    attend_batched,
    attend_rows,
    row_reads,
    token_rows,
)
from engine.runner.decode_step import DecodeGraphs, DecodeStep, bucket, build_step
from engine.runner.flex_paged import FlexMasks, FlexPaged, check_block_size
from engine.runner.penalties import PenaltyState
from engine.types import DEFAULT_BLOCK_SIZE, AttentionPath
from kvstore.types import kv_token_bytes

# Positions per sequence when neither the setting nor the model bounds them.
DEFAULT_MAX_MODEL_LEN = 8192

# What a decode step reads (`ModelRunner.attention`).
StepReads = Reads | FlexMasks


def available_ram_bytes() -> int:
    """MemAvailable (free plus reclaimable cache), or the free pages where /proc is absent."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def model_len(ops: LayerOps, requested: int | None) -> int:
    """Positions per sequence (`max_model_len`): the setting, within the model's bound."""
    limit = ops.max_positions or DEFAULT_MAX_MODEL_LEN
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if not 1 <= requested <= limit:
        raise ValueError(f"max_model_len must be in 1..{limit} (the model's), got {requested}")
    return requested


def pool_bytes(ops: LayerOps, num_tokens: int) -> int:
    shape = ops.shape
    token_bytes = kv_token_bytes(shape.num_kv_heads, shape.head_dim, ops.dtype, shape.num_layers)
    return token_bytes * num_tokens


def fit_blocks(
    ops: LayerOps, max_num_seqs: int, max_model_len: int, block_size: int, budget_bytes: int | None
) -> int:
    """How many blocks of `block_size` the pool holds: as many as the budget (default: half the
    free GPU memory, or a quarter of the available RAM), but no more than `max_num_seqs`
    sequences of `max_model_len` fill (the rest could never be used), and at least one such
    sequence (else a prompt the engine accepts could never be admitted)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    block_bytes = pool_bytes(ops, block_size)
    budget = budget_bytes if budget_bytes is not None else _default_pool_bytes(ops.device)
    per_seq = -(-max_model_len // block_size)
    num_blocks = min(max_num_seqs * per_seq, budget // block_bytes)
    if num_blocks < per_seq:
        need = per_seq * block_bytes
        raise ValueError(
            f"the KV pool of {budget / 2**30:.2f} GiB holds no sequence of max_model_len "
            f"{max_model_len} ({need / 2**30:.2f} GiB): raise the pool or lower max_model_len"
        )
    return num_blocks


def _default_pool_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return available_ram_bytes() // 4


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lies on fresh anonymous pages, which the kernel zeroes as
    they are first written: the pool takes RAM as its blocks come into use (lowest ids first,
    engine/sched/blocks.py), where torch.zeros would write all of it at start."""
    numel = math.prod(shape)
    if device.type != "cpu" or not numel:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, numel * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class ModelRunner:
    """The KV pool as blocks of `block_size` positions and a batched decode that reads each
    sequence's blocks through its block table (a list of block ids, in position order).

    Pool: keys and values [L, N, block_size, H_kv, D], token-major within a block: a run of
    consecutive blocks is the sequence's [T, H_kv, D] rows in order, which a transposed view
    hands to SDPA without a copy, and gathering scattered blocks gives the same rows in one
    copy (on the CPU faster than head-major blocks, whose gather permutes).
    """

    def __init__(
        self, ops: LayerOps, num_blocks: int, block_size: int, max_model_len: int, num_lanes: int
    ):
        self.ops = ops
        shape = ops.shape
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        # One block more than the block manager hands out: the padding rows of a step padded to
        # a bucket (engine/decode_step.py) write and read it, and nothing else does.
        self.scratch = num_blocks
        blocks = num_blocks + 1
        pool_shape = (shape.num_layers, blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # Zeros, not empty: a padded row multiplies masked-out values by exactly 0, and 0 * NaN
        # from uninitialised memory would poison it.
        try:
            self.keys = zeroed_pool(pool_shape, ops.dtype, ops.device)
            self.values = zeroed_pool(pool_shape, ops.dtype, ops.device)
        except (RuntimeError, OSError) as exc:  # torch.OutOfMemoryError is one
            size = pool_bytes(ops, blocks * block_size) / 2**30
            raise ValueError(
                f"the KV pool of {num_blocks} blocks x {block_size} positions ({size:.2f} GiB) "
                f"does not fit on {ops.device}: lower kv_pool_gb, max_num_seqs or max_model_len"
            ) from exc
        self.cos, self.sin = ops.rope_tables(max_model_len)  # [C, D]
        self.group = shape.num_heads // shape.num_kv_heads
        self.flex = FlexPaged(block_size, self.scratch, self.group, ops.device.type == "cuda")
        self.attention_path: AttentionPath
        self.use_attention("auto")
        self.max_view_runs = MAX_VIEW_RUNS
        # Batched steps padded to buckets (what CUDA graphs replay; `bucketed` alone: the same
        # padding, eagerly, which the CPU tests check).
        self.graphs: DecodeGraphs | None = None
        self.bucketed = False
        self.max_width = -(-max_model_len // block_size)
        vocab_size = ops.model.lm_head.weight.shape[0]  # the width of the logits
        # One row per lane: the small id each running sequence holds (engine/sched/scheduler.py).
        self.penalties = PenaltyState(num_lanes, vocab_size, ops.device)

    @classmethod
    def sized(
        cls,
        ops: LayerOps,
        max_num_seqs: int,
        max_model_len: int | None,
        kv_pool_bytes: int | None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> ModelRunner:
        """A pool of as many blocks as fit (`fit_blocks`), for `model_len(max_model_len)`."""
        length = model_len(ops, max_model_len)
        num_blocks = fit_blocks(ops, max_num_seqs, length, block_size, kv_pool_bytes)
        return cls(ops, num_blocks, block_size, length, max_num_seqs)

    @property
    def per_row(self) -> bool:
        return self.attention_path == "per_row"

    def use_attention(self, path: str) -> None:
        """Read the blocks `path`'s way (an AttentionPath), or "auto": the device's default,
        one SDPA per row over views of its blocks on the CPU (engine/paged_attention.py), one
        batched SDPA over gathered blocks elsewhere; "flex": flex_attention over the blocks in
        place (engine/flex_paged.py). Per row merges its runs with the CPU's flash kernel, so
        it takes the CPU only."""
        device = self.ops.device
        if path == "auto":
            path = "per_row" if device.type == "cpu" else "batched"
        if path not in get_args(AttentionPath):
            choices = ", ".join(["auto", *get_args(AttentionPath)])
            raise ValueError(f"decode attention must be one of {choices}, got {path!r}")
        if path == "per_row" and device.type != "cpu":
            raise ValueError(f"per-row decode attention runs on the CPU only, not {device}")
        if path == "flex":
            check_block_size(self.block_size, device)
        self.attention_path = cast(AttentionPath, path)

    def write_prompt(
        self, table: list[int], keys: torch.Tensor, values: torch.Tensor, start: int = 0
    ) -> None:
        """Copy a prompt's KV [L, H_kv, n, D] into the first blocks of `table`, from position
        `start` on: the blocks before it are shared (engine/shared_prefix.py), never written."""
        device = self.ops.device
        rows = token_rows(
            torch.tensor(table, device=device),
            torch.arange(start, keys.shape[2], device=device),
            self.block_size,
        )
        flat_keys, flat_values = self.keys.flatten(1, 2), self.values.flatten(1, 2)
        flat_keys[:, rows] = keys[:, :, start:].transpose(1, 2)
        flat_values[:, rows] = values[:, :, start:].transpose(1, 2)

    def use_cuda_graphs(self, max_batch: int) -> None:
        """Replay the batched (or flex) decode step from CUDA graphs for up to `max_batch`
        rows."""
        if self.ops.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.ops.device}")
        if self.attention_path == "per_row":
            self.attention_path = "batched"
        self.bucketed = True
        self.graphs = DecodeGraphs(
            lambda step: self.forward(step, self.step_reads(step)), max_batch, self.max_width
        )

    @torch.inference_mode()
    def decode(
        self, tables: list[list[int]], positions: list[int], token_ids: list[int]
    ) -> torch.Tensor:
        """Feed token_ids[b] at positions[b] of the sequence whose blocks are tables[b]; logits
        [B, vocab] (float32).

        The blocks of row b must hold the KV of positions 0..positions[b]-1; the new K/V are
        written at positions[b], in place, and each row attends over its own positions (and
        sliding window): per row on the CPU, batched elsewhere, or by flex_attention
        (`attention`), its step padded to a bucket and replayed from a CUDA graph where
        `use_cuda_graphs` said so.
        """
        batch, shape = len(tables), None
        if self.bucketed:
            width = max(p // self.block_size for p in positions) + 1
            graphs = self.graphs
            shape = graphs.shape(batch, width) if graphs else bucket(batch, width, self.max_width)
        step = self.step(tables, positions, token_ids, shape)
        if self.graphs is not None and shape is not None:
            return self.graphs.run(step)[:batch]
        return self.forward(step, self.reads_of(step, tables, positions))[:batch]

    def step(
        self,
        tables: list[list[int]],
        positions: list[int],
        token_ids: list[int],
        shape: tuple[int, int] | None = None,
    ) -> DecodeStep:
        """The step's inputs on the device (`build_step`); no block table for per-row reads,
        no masks for flex's (its block masks are built from the table, `step_reads`)."""
        windows = {"per_row": None, "batched": set(self.ops.windows), "flex": set()}
        return build_step(
            tables,
            positions,
            token_ids,
            block_size=self.block_size,
            scratch=self.scratch,
            windows=windows[self.attention_path],
            device=self.ops.device,
            shape=shape,
        )

    def forward(self, step: DecodeStep, reads: StepReads) -> torch.Tensor:
        """The decode layer loop over `step`'s rows, run at once; logits [rows, vocab]."""
        return run_to_end(self.layers(step, reads))

    def decode_steps(
        self, tables: list[list[int]], positions: list[int], token_ids: list[int]
    ) -> Pausable[torch.Tensor]:
        """`decode` as a pausable that hands out its dense work: the executor runs it with the
        step's prefills, its rows in their projections and MLPs (engine/blend/dense.py)."""
        step = self.step(tables, positions, token_ids)
        return self.layers(step, self.reads_of(step, tables, positions))

    def layers(self, step: DecodeStep, reads: StepReads) -> Pausable[torch.Tensor]:
        """The decode layer loop over `step`'s rows, its projections and MLPs handed out as
        Dense work; logits [rows, vocab] (float32)."""
        ops, shape = self.ops, self.ops.shape
        batch = step.token_ids.shape[0]
        cos, sin = self.cos[step.pos], self.sin[step.pos]  # [B, D]
        h = ops.embed(step.token_ids)  # [B, d]
        for i in range(shape.num_layers):
            q, k, v = yield Dense(ops, i, h)  # q [H, B, D], k/v [H_kv, B, D]
            q = ops.rotate(q, cos, sin)
            k = ops.rotate(k, cos, sin)
            self.keys[i].flatten(0, 1)[step.new_rows] = k.transpose(0, 1)
            self.values[i].flatten(0, 1)[step.new_rows] = v.transpose(0, 1)
            # One query per sequence: the G query heads of a KV group attend as G rows over the
            # same keys, which needs no GQA support from the kernel.
            q_rows = q.transpose(0, 1).reshape(batch, shape.num_kv_heads, self.group, -1)
            out = self.attention(i, q_rows, reads)
            h = yield Dense(ops, i, h, out.reshape(batch, -1))
        return ops.logits_batch(h)

    def reads_of(
        self, step: DecodeStep, tables: list[list[int]], positions: list[int]
    ) -> StepReads:
        """What `step`'s rows read: views of their blocks (per row), or `step_reads`."""
        return self._row_reads(tables, positions) if self.per_row else self.step_reads(step)

    def step_reads(self, step: DecodeStep) -> StepReads:
        """What a batched or flex step reads: its table and masks, or its block masks (tensor
        work only, which a CUDA graph captures)."""
        if self.attention_path == "flex":
            return self.flex.masks(step.table, step.pos, set(self.ops.windows))
        return step.table, step.masks

    def reads(self, tables: list[list[int]], positions: list[int]) -> StepReads:
        """What `attention` reads for rows whose last positions are `positions`."""
        if self.per_row:
            return self._row_reads(tables, positions)
        return self.step_reads(self.step(tables, positions, [0] * len(tables)))

    def attention(self, i: int, q_rows: torch.Tensor, reads: StepReads) -> torch.Tensor:
        """Layer i's attention of queries [B, H_kv, G, D] over each row's keys; [B, H_kv, G, D]:
        per row over views of its blocks on the CPU, batched over gathered blocks elsewhere,
        or by flex_attention over the blocks in place."""
        window, scale = self.ops.windows[i], self.ops.attention_scale(i)
        if isinstance(reads, list):
            keys, values = self.keys[i].flatten(0, 1), self.values[i].flatten(0, 1)
            return attend_rows(q_rows, keys, values, reads, window, scale)
        if isinstance(reads, dict):
            return self.flex.attend(q_rows, self.keys[i], self.values[i], reads[window], scale)
        table, masks = reads
        return attend_batched(q_rows, self.keys[i], self.values[i], table, masks[window], scale)

    def _row_reads(self, tables: list[list[int]], positions: list[int]) -> list[RowRead]:
        return row_reads(tables, positions, self.block_size, self.max_view_runs, self.ops.device)
