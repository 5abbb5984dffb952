"""A batched decode step's inputs on the device, padded to a bucket when asked, and the CUDA
graphs that replay the step per bucket (launch-bound eager steps become one replay each)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Batch sizes a graph is captured for; a step pads its rows up to the next one.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DecodeStep:
    """Row b feeds token_ids[b] at pos[b], its new K/V going to row new_rows[b] of the pool
    flattened to [N * block_size, H_kv, D]; it reads the blocks table[b] ([B, W]) under
    masks[window][b] ([B, 1, 1, W * block_size], one per sliding window of the model)."""

    token_ids: torch.Tensor
    pos: torch.Tensor
    new_rows: torch.Tensor
    table: torch.Tensor
    masks: dict[int | None, torch.Tensor]

    def copy_(self, other: DecodeStep) -> None:
        """Write `other`'s values into these tensors (a graph's static inputs)."""
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.copy_(theirs)

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, self.pos, self.new_rows, self.table, *self.masks.values()]


def build_step(
    tables: list[list[int]],
    positions: list[int],
    token_ids: list[int],
    *,
    block_size: int,
    scratch: int,
    windows: set[int | None] | None,
    device: torch.device,
    shape: tuple[int, int] | None = None,
) -> DecodeStep:
    """The step's inputs for the real rows, padded to `shape` (batch, width in blocks) when
    given: short tables with the `scratch` block (masked out), and padding rows of token 0 at
    position 0 of the scratch block, which they alone write and read (a block the block
    manager never hands out), so no real sequence's KV is touched. `windows` None: no block
    table or masks (rows that read their blocks as views, the CPU's per-row attention)."""
    width = 0 if windows is None else max(p // block_size for p in positions) + 1
    batch, width = shape or (len(tables), width)
    pad = batch - len(tables)
    rows = [t[:width] + [scratch] * (width - len(t[:width])) for t in tables]
    rows += [[scratch] * width] * pad
    new_rows = [
        t[p // block_size] * block_size + p % block_size
        for t, p in zip(tables, positions, strict=True)
    ]
    new_rows += [scratch * block_size] * pad
    pos = torch.tensor(positions + [0] * pad, device=device)
    key_pos = torch.arange(width * block_size, device=device)[None, :]
    causal = key_pos <= pos[:, None]
    masks = {
        window: (causal if window is None else causal & (key_pos > pos[:, None] - window))[
            :, None, None
        ]
        for window in windows or ()
    }
    return DecodeStep(
        torch.tensor(token_ids + [0] * pad, device=device),
        pos,
        torch.tensor(new_rows, device=device),
        torch.tensor(rows, dtype=torch.long, device=device).view(batch, width),
        masks,
    )


def bucket(batch: int, width: int, max_width: int) -> tuple[int, int] | None:
    """The (batch, width) a step of `batch` rows over `width` blocks pads to: the next batch
    bucket and the next power of two of blocks (at most `max_width`); None past the buckets."""
    fits = [b for b in BATCH_BUCKETS if b >= batch]
    if not fits:
        return None
    return fits[0], min(1 << (width - 1).bit_length(), max_width)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: DecodeStep
    logits: torch.Tensor


class DecodeGraphs:
    """CUDA graphs of `forward` (the runner's decode layer loop over a DecodeStep), one per
    (batch, width) bucket up to `max_batch` rows, captured at its first use in a memory pool
    they share; a step past the buckets runs eagerly. Replaying writes the new K/V into the
    pool like the eager step (the graph holds the pool's addresses)."""

    def __init__(
        self, forward: Callable[[DecodeStep], torch.Tensor], max_batch: int, max_width: int
    ):
        self.forward = forward
        self.max_batch = max_batch
        self.max_width = max_width
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def shape(self, batch: int, width: int) -> tuple[int, int] | None:
        """The bucket a step pads to, or None when it runs eagerly."""
        if batch > self.max_batch:
            return None
        return bucket(batch, width, self.max_width)

    def run(self, step: DecodeStep) -> torch.Tensor:
        """Logits [batch bucket, vocab] of a step padded to its bucket (slice the real rows)."""
        key = (step.table.shape[0], step.table.shape[1])
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(step)
        graph.inputs.copy_(step)
        graph.graph.replay()
        return graph.logits

    def _capture(self, step: DecodeStep) -> _Graph:
        # Warm-up on a side stream first (kernels pick their algorithms there, not during the
        # capture); it writes this step's K/V at this step's rows, as the replay will.
        inputs = DecodeStep(
            step.token_ids.clone(),
            step.pos.clone(),
            step.new_rows.clone(),
            step.table.clone(),
            {window: mask.clone() for window, mask in step.masks.items()},
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(inputs)
        log.info("captured the decode step for %d rows over %d blocks", *step.table.shape)
        return _Graph(graph, inputs, logits)
