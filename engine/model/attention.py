"""Which attention kernel serves which queries of a prefill: plain bookkeeping on positions, plus
the masks and buffers it needs, built once per query set and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Queries per masked attention call when only some positions are computed.
ATTENTION_BLOCK = 256
# A contiguous run at positions a..b-1 goes to the causal kernel (over keys 0..b-1, with a
# padding rows in front) when a <= CAUSAL_PADDING * (b - a): at most 4/3 of the masked path's
# FLOPs, and on the CPU the masked kernel costs more per key than the causal one
# (docs/benchmarks/engine-ttft.md).
CAUSAL_PADDING = 1.0
# Shorter runs are not worth a call of their own: they join the masked blocks.
MIN_CAUSAL_RUN = 64


@dataclass(frozen=True)
class QuerySpan:
    """Queries start..end-1 (indices into the sorted positions) needing keys 0..key_end-1.
    `causal`: they are exactly positions key_end - (end - start) .. key_end - 1."""

    start: int
    end: int
    key_end: int
    causal: bool


def query_spans(positions: list[int]) -> list[QuerySpan]:
    """Split sorted, unique positions into causal runs and masked blocks of ATTENTION_BLOCK."""
    spans: list[QuerySpan] = []
    pending = 0  # first query not yet in a span
    run_start = 0
    for i in range(len(positions)):
        last_of_run = i + 1 == len(positions) or positions[i + 1] != positions[i] + 1
        if not last_of_run:
            continue
        first, length = positions[run_start], i + 1 - run_start
        if length >= MIN_CAUSAL_RUN and first <= CAUSAL_PADDING * length:
            spans += _masked(positions, pending, run_start)
            spans.append(QuerySpan(run_start, i + 1, positions[i] + 1, causal=True))
            pending = i + 1
        run_start = i + 1
    return spans + _masked(positions, pending, len(positions))


def _masked(positions: list[int], start: int, end: int) -> list[QuerySpan]:
    return [
        QuerySpan(
            s,
            min(s + ATTENTION_BLOCK, end),
            positions[min(s + ATTENTION_BLOCK, end) - 1] + 1,
            False,
        )
        for s in range(start, end, ATTENTION_BLOCK)
    ]


class AttentionPlan:
    """The spans of one query set, with the additive masks of its masked blocks (one set per
    sliding window) and the padded query buffers of its causal runs, each built on first use."""

    def __init__(self, positions: list[int], dtype: torch.dtype, device: torch.device):
        self.positions = positions
        self.spans = query_spans(positions)
        self.dtype, self.device = dtype, device
        self._masks: dict[tuple[int, int, int | None], torch.Tensor] = {}
        self._padded: dict[int, torch.Tensor] = {}

    def blocks(self, span: QuerySpan) -> list[QuerySpan]:
        """A masked span as itself; a causal run (a layer's window too short for it) in blocks."""
        return _masked(self.positions, span.start, span.end) if span.causal else [span]

    def mask(self, block: QuerySpan, window: int | None) -> torch.Tensor:
        """[n, key_end] additive mask: 0 where the query may see the key, -inf elsewhere."""
        key = (block.start, block.end, window)
        if key not in self._masks:
            queries = torch.tensor(self.positions[block.start : block.end], device=self.device)
            keys = torch.arange(block.key_end, device=self.device)[None, :]
            visible = keys <= queries[:, None]
            if window is not None:
                visible &= keys > queries[:, None] - window
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            self._masks[key] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[key]

    def padded_queries(self, span: QuerySpan, num_heads: int, head_dim: int) -> torch.Tensor:
        """[H, key_end, D]: zero rows, then room for the run's queries (the caller fills it)."""
        if span.start not in self._padded:
            self._padded[span.start] = torch.zeros(
                num_heads, span.key_end, head_dim, dtype=self.dtype, device=self.device
            )
        return self._padded[span.start]
