"""A decode row's attention over its KV blocks read in place by flex_attention: a block mask
built from the block tables lists each row's own blocks, so the kernel reads no other block."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.runner.decode_step import BATCH_BUCKETS

# One block mask per sliding window of the model (None: none), shared by a step's layers.
FlexMasks = dict[int | None, BlockMask]

# The block mask's query block: a row's G queries (query heads per KV head, 1-8 in the models
# served) fit one; flex's CUDA decoding kernel needs a multiple of its BLOCK_M, 16 or more.
QUERY_BLOCK = 128


def check_block_size(block_size: int, device: torch.device) -> None:
    """Flex's CUDA kernels step through a KV block in tiles of at least 16 keys (Triton's
    smallest dot), a power of two, so a pool block must be one; the CPU takes any size."""
    if device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(
            f"flex decode attention on CUDA needs a block_size that is a power of two of 16 "
            f"or more, the pool's is {block_size}"
        )


def padded_batch(rows: int) -> int:
    """The rows a compiled step pads to: the next batch bucket, then multiples of the largest,
    so that a kernel specialised to its batch (flex's decoding kernel wants a static one)
    compiles a few times, not once per batch size."""
    largest = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= rows), -(-rows // largest) * largest)


class FlexPaged:
    """Decode attention of queries [B, H_kv, G, D] over a layer's pool [N + 1, block_size,
    H_kv, D] (block `scratch` = N is the padding rows'), flattened to one KV sequence of
    (N + 1) * block_size keys that every row shares (KV batch 1, broadcast): the block mask
    of row b lists its blocks, and its mask_mod keeps the positions it attends to.

    `compiled` (CUDA): flex_attention compiled once per batch bucket, rows padded to it.
    Otherwise flex's eager reference, which scores every key of the pool and masks: exact,
    not fast (the CPU's decode reads per row, engine/paged_attention.py)."""

    def __init__(self, block_size: int, scratch: int, group: int, compiled: bool):
        self.block_size, self.scratch, self.group = block_size, scratch, group
        self.compiled = compiled

    def masks(self, table: torch.Tensor, pos: torch.Tensor, windows: set[int | None]) -> FlexMasks:
        """The block masks of rows that read the blocks table[b] ([B, W], in position order)
        up to pos[b], one per window; padded with rows of the scratch block where compiled."""
        batch = table.shape[0]
        pad = padded_batch(batch) - batch if self.compiled else 0
        if pad:
            table = F.pad(table, (0, 0, 0, pad), value=self.scratch)
            pos = F.pad(pos, (0, pad))
        logical = self.logical_blocks(table, pos)
        return {window: self.block_mask(table, pos, logical, window) for window in windows}

    def logical_blocks(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[B, N + 1]: the column of row b's table that holds block n up to pos[b], or -1."""
        batch, width = table.shape
        pool_blocks = self.scratch + 1
        logical = torch.full((batch, pool_blocks + 1), -1, dtype=torch.int32, device=table.device)
        cols = torch.arange(width, device=table.device)
        # Columns past a row's last block (padding, or blocks reserved but not yet written) go
        # to a dropped column, so that a block maps to the one column that holds it in use.
        used = torch.where(cols <= (pos // self.block_size)[:, None], table, pool_blocks)
        logical.scatter_(1, used, cols.to(torch.int32).expand(batch, width))
        return logical[:, :pool_blocks]

    def block_mask(
        self, table: torch.Tensor, pos: torch.Tensor, logical: torch.Tensor, window: int | None
    ) -> BlockMask:
        """Row b attends to positions earliest[b]..pos[b] of its table (the last `window`):
        its blocks from the one holding earliest[b] to the one holding pos[b] are listed, and
        the mask_mod maps a key back to its position through `logical` (`logical_blocks`)."""
        size, pool_blocks = self.block_size, self.scratch + 1
        width = table.shape[1]
        earliest = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
        first = earliest // size
        cols = torch.arange(width, device=table.device)
        listed = table.gather(1, (first[:, None] + cols).clamp(max=width - 1))
        # As wide as the pool: flex's compiled CPU kernel asserts the indices cover the KV
        # sequence; entries past a row's count are never read.
        kv_indices = F.pad(listed, (0, pool_blocks - width)).to(torch.int32)
        kv_num_blocks = (pos // size - first + 1).to(torch.int32)
        return BlockMask.from_kv_blocks(
            kv_num_blocks[:, None, None],
            kv_indices[:, None, None],
            BLOCK_SIZE=(QUERY_BLOCK, size),
            mask_mod=_visible(logical, earliest, pos, size),
            seq_lengths=(self.group, pool_blocks * size),
            compute_q_blocks=False,
        )

    def attend(
        self,
        q_rows: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: BlockMask,
        scale: float,
    ) -> torch.Tensor:
        """Attention of q_rows [B, H_kv, G, D] over a layer's pool [N + 1, block_size, H_kv, D]
        under `mask` (`masks`); [B, H_kv, G, D]. The pool is read as one transposed view, no
        copy; the G query heads of a KV group are a row's G queries."""
        batch, rows = q_rows.shape[0], mask.kv_num_blocks.shape[0]
        q = F.pad(q_rows, (0, 0, 0, 0, 0, 0, 0, rows - batch)) if rows > batch else q_rows
        k = keys.flatten(0, 1).transpose(0, 1)[None]
        v = values.flatten(0, 1).transpose(0, 1)[None]
        if self.compiled:
            out = _compiled_flex()(q, k, v, block_mask=mask, scale=scale)
        else:
            out = flex_attention(q, k, v, block_mask=mask, scale=scale)
        return out[:batch]


def _visible(
    logical: torch.Tensor, earliest: torch.Tensor, pos: torch.Tensor, size: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mask_mod: key `kv_idx` of the flattened pool is visible to row b iff its block is
    logical block j of b's table and j * size + kv_idx % size is in earliest[b]..pos[b]."""

    def visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        # A block outside b's table maps to -1, a negative position, never visible.
        position = logical[b, kv_idx // size] * size + kv_idx % size
        return (position >= earliest[b]) & (position <= pos[b])

    return visible


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled once per process, a graph per batch bucket: dynamo's
    recompile_limit (8) covers the 7 buckets up to 64 rows and 128; a ninth batch would run
    flex's eager reference instead."""
    return torch.compile(flex_attention, dynamic=False)
