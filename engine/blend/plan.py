"""The per-request prefill plan: where each token's KV comes from in each mode.

Plain bookkeeping on positions, no tensors: the blend loop in `engine/blend.py` executes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from engine.blend.layout import PromptLayout
from engine.blend.selection import Selection
from engine.types import Mode


class ChunkSource(StrEnum):
    COMPUTE = "compute"  # no usable cache: computed in every layer
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
    # The auto ratio: each check layer keeps what covers this share of the selection's mass,
    # between min_ratio and its share of recompute_ratio (the bound). None: exactly the ratio.
    coverage: float | None = None
    min_ratio: float = 0.0
    # Research only (engine/oracle.py): a score per blended token, in blend_positions order,
    # that ranks them instead of the selection.
    token_scores: tuple[float, ...] | None = None
    # Top alternatives of each prompt token's log-probability (None: none computed); needs
    # every position computed through the last layer, as full prefill does.
    prompt_logprobs: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def suffix_start(self) -> int:
        """The first position after the chunks: the question and the answer's header."""
        if not self.chunk_spans:
            return self.prefix_len
        start, length = self.chunk_spans[-1]
        return start + length

    @property
    def streamed_chunks(self) -> list[int]:
        """Indices of the chunks whose KV is read from the store, in prompt order."""
        return [j for j, s in enumerate(self.chunk_sources) if s is not ChunkSource.COMPUTE]

    @property
    def first_streamed_layer(self) -> int:
        """The first layer whose chunk KV the blend loop reads (`first_streamed_layer`)."""
        blends = self.count_tokens(ChunkSource.BLEND) > 0
        return first_streamed_layer(self.recompute_ratio if blends else 0.0, self.check_layers)

    @property
    def blend_positions(self) -> list[int]:
        return self._positions(ChunkSource.BLEND)

    @property
    def always_computed_positions(self) -> list[int]:
        """Positions computed in every layer: uncached prefix, uncached chunks, the suffix."""
        prefix = [] if self.prefix_cached else list(range(self.prefix_len))
        return (
            prefix
            + self._positions(ChunkSource.COMPUTE)
            + list(range(self.suffix_start, self.num_tokens))
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


def first_streamed_layer(recompute_ratio: float, check_layers: tuple[int, ...]) -> int:
    """The first layer whose chunk KV a blend reads. Before the first check layer every blended
    token is recomputed, so its cached KV is not needed there, unless nothing is selected
    (ratio 0: nothing is recomputed, every layer reads the cache)."""
    return min(check_layers) if recompute_ratio > 0 and check_layers else 0


def plan_prefill(
    layout: PromptLayout,
    mode: Mode,
    chunk_cached: Sequence[bool],
    prefix_cached: bool,
    recompute_ratio: float,
    check_layers: tuple[int, ...],
    selection: Selection = Selection.HKVD,
) -> PrefillPlan:
    """Decide each chunk's KV source for `mode`.

    Cached chunks are blended in `cacheblend` and `full_reuse` (blending with ratio 0);
    `prefix_cache` reuses only the cached prompt prefix and `full_prefill` nothing at all. No
    chunk is ever an exact hit: every prompt's prefix holds the template and the system prompt,
    so no chunk follows exactly the chunk-precompute prefix its KV was computed behind.
    """
    blends = mode in (Mode.CACHEBLEND, Mode.FULL_REUSE)
    sources = [
        ChunkSource.BLEND if blends and cached else ChunkSource.COMPUTE for cached in chunk_cached
    ]
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
