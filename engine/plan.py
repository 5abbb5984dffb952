"""The per-request prefill plan: where each token's KV comes from in each mode.

Plain bookkeeping on positions, no tensors: the blend loop in `engine/blend.py` executes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from engine.prompt import PromptLayout
from engine.selection import Selection
from engine.types import Mode


class ChunkSource(StrEnum):
    COMPUTE = "compute"  # no usable cache: computed in every layer
    EXACT = (
        "exact"  # cached KV is exactly what full prefill gives (the chunk follows the BOS prefix)
    )
    BLEND = "blend"  # cached KV, a selected fraction recomputed


@dataclass(frozen=True)
class PrefillPlan:
    token_ids: tuple[int, ...]
    prefix_len: int
    prefix_cached: bool
    chunk_spans: tuple[tuple[int, int], ...]
    chunk_sources: tuple[ChunkSource, ...]
    recompute_ratio: float
    check_layers: tuple[int, ...]
    keep_pre_rope_keys: bool = False
    selection: Selection = Selection.HKVD  # how the check layers pick tokens to recompute

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def streamed_chunks(self) -> list[int]:
        """Indices of the chunks whose KV is read from the store, in prompt order."""
        return [j for j, s in enumerate(self.chunk_sources) if s is not ChunkSource.COMPUTE]

    @property
    def first_streamed_layer(self) -> int:
        """The first layer whose chunk KV the blend loop reads. Before the first check layer
        every blended token is recomputed, so its cached KV is not needed there, unless the
        plan does not select (ratio 0, nothing to blend) or an exact chunk, never recomputed,
        shares the stream."""
        selects = self.recompute_ratio > 0 and self.count_tokens(ChunkSource.BLEND) > 0
        if not selects or not self.check_layers or ChunkSource.EXACT in self.chunk_sources:
            return 0
        return min(self.check_layers)

    @property
    def blend_positions(self) -> list[int]:
        return self._positions(ChunkSource.BLEND)

    @property
    def always_computed_positions(self) -> list[int]:
        """Positions computed in every layer: uncached prefix, uncached chunks, the suffix."""
        prefix = [] if self.prefix_cached else list(range(self.prefix_len))
        suffix_start = (
            self.chunk_spans[-1][0] + self.chunk_spans[-1][1]
            if self.chunk_spans
            else self.prefix_len
        )
        return (
            prefix
            + self._positions(ChunkSource.COMPUTE)
            + list(range(suffix_start, self.num_tokens))
        )

    def _positions(self, source: ChunkSource) -> list[int]:
        return [
            p
            for (start, length), s in zip(self.chunk_spans, self.chunk_sources, strict=True)
            if s is source
            for p in range(start, start + length)
        ]

    def count_tokens(self, source: ChunkSource) -> int:
        return len(self._positions(source))


def plan_prefill(
    layout: PromptLayout,
    mode: Mode,
    chunk_cached: Sequence[bool],
    prefix_cached: bool,
    chunk_prefix: tuple[int, ...],
    recompute_ratio: float,
    check_layers: tuple[int, ...],
    selection: Selection = Selection.HKVD,
) -> PrefillPlan:
    """Decide each chunk's KV source for `mode`.

    A cached first chunk directly behind a prefix equal to the chunk-precompute prefix is an
    exact prefix hit in every reuse mode; `prefix_cache` reuses nothing else, `full_reuse` is
    blending with ratio 0, and `full_prefill` reuses nothing at all.
    """
    exact_first = bool(chunk_cached) and chunk_cached[0] and layout.prefix == chunk_prefix
    sources = []
    for j, cached in enumerate(chunk_cached):
        if mode is Mode.FULL_PREFILL or not cached:
            sources.append(ChunkSource.COMPUTE)
        elif j == 0 and exact_first:
            sources.append(ChunkSource.EXACT)
        elif mode is Mode.PREFIX_CACHE:
            sources.append(ChunkSource.COMPUTE)
        else:
            sources.append(ChunkSource.BLEND)
    ratio = {Mode.FULL_REUSE: 0.0, Mode.FULL_PREFILL: 1.0, Mode.PREFIX_CACHE: 1.0}.get(
        mode, recompute_ratio
    )
    return PrefillPlan(
        token_ids=layout.token_ids,
        prefix_len=len(layout.prefix),
        prefix_cached=prefix_cached and mode is not Mode.FULL_PREFILL,
        chunk_spans=layout.chunk_spans,
        chunk_sources=tuple(sources),
        recompute_ratio=ratio,
        check_layers=check_layers,
        selection=selection,
    )
