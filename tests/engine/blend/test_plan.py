"""The prefill plan: each chunk's KV source and the ratio per mode, and the positions computed
in every layer (plain bookkeeping, no model)."""

from __future__ import annotations

import pytest

from engine.blend.layout import PromptLayout
from engine.blend.plan import ChunkSource, plan_prefill
from engine.blend.selection import Selection
from engine.types import Mode

BOS = (1,)  # the chunk-precompute prefix
CHUNKS = ((10, 11, 12), (20, 21), (30, 31, 32, 33))
SUFFIX = (90, 91)


def plan(mode, cached=(True, True, True), prefix=(1, 5, 6), prefix_cached=True, ratio=0.15):
    layout = PromptLayout(prefix, CHUNKS, SUFFIX)
    return plan_prefill(layout, mode, cached, prefix_cached, ratio, (1,))


def test_cacheblend_blends_cached_chunks_and_computes_missing_ones_at_the_asked_ratio():
    p = plan(Mode.CACHEBLEND, cached=(True, False, True), ratio=0.3)
    assert p.chunk_sources == (ChunkSource.BLEND, ChunkSource.COMPUTE, ChunkSource.BLEND)
    assert p.recompute_ratio == 0.3
    assert p.streamed_chunks == [0, 2]
    assert p.blend_positions == [3, 4, 5, 8, 9, 10, 11]


def test_full_prefill_computes_everything_and_uses_no_cached_prefix():
    p = plan(Mode.FULL_PREFILL)
    assert set(p.chunk_sources) == {ChunkSource.COMPUTE}
    assert (p.recompute_ratio, p.prefix_cached, p.streamed_chunks) == (1.0, False, [])
    assert p.always_computed_positions == list(range(p.num_tokens))


def test_full_reuse_is_blending_at_ratio_zero():
    p = plan(Mode.FULL_REUSE, ratio=0.5)
    assert set(p.chunk_sources) == {ChunkSource.BLEND}
    assert p.recompute_ratio == 0.0


@pytest.mark.parametrize("prefix", [BOS, (1, 5, 6)])
def test_prefix_cache_computes_every_chunk_whatever_the_prefix(prefix):
    p = plan(Mode.PREFIX_CACHE, prefix=prefix)
    assert set(p.chunk_sources) == {ChunkSource.COMPUTE}
    assert (p.prefix_cached, p.streamed_chunks, p.recompute_ratio) == (True, [], 1.0)


@pytest.mark.parametrize("prefix", [BOS, (1, 5, 6)])
def test_a_cached_first_chunk_is_blended_like_the_others_whatever_the_prefix(prefix):
    assert plan(Mode.CACHEBLEND, prefix=prefix).chunk_sources == (ChunkSource.BLEND,) * 3


def test_always_computed_positions_are_the_uncached_prefix_computed_chunks_and_suffix():
    p = plan(Mode.CACHEBLEND, cached=(True, False, True), prefix_cached=False)
    assert p.always_computed_positions == [0, 1, 2, 6, 7, 12, 13]
    cached_prefix = plan(Mode.CACHEBLEND, cached=(True, False, True))
    assert cached_prefix.always_computed_positions == [6, 7, 12, 13]


def test_without_chunks_only_the_prefix_and_suffix_are_computed():
    layout = PromptLayout((1, 5), (), SUFFIX)
    p = plan_prefill(layout, Mode.CACHEBLEND, (), False, 0.15, (1,))
    assert (p.chunk_sources, p.streamed_chunks) == ((), [])
    assert p.always_computed_positions == [0, 1, 2, 3]


def test_cacheblend_reads_the_stream_from_the_first_check_layer():
    layout = PromptLayout((1, 5, 6), CHUNKS, SUFFIX)
    p = plan_prefill(layout, Mode.CACHEBLEND, (True, False, True), True, 0.15, (2, 3))
    assert p.first_streamed_layer == 2


@pytest.mark.parametrize(
    "case",
    [
        {"mode": Mode.FULL_REUSE},  # ratio 0: no layer recomputes the blended tokens
        {"mode": Mode.CACHEBLEND, "ratio": 0.0},
        {"mode": Mode.PREFIX_CACHE},
        {"mode": Mode.CACHEBLEND, "cached": (False, False, False)},  # nothing to blend
    ],
)
def test_the_stream_is_read_from_layer_0_unless_the_plan_selects_among_blended_chunks_only(case):
    assert plan(**case).first_streamed_layer == 0


def test_plan_carries_the_selection_and_defaults_to_hkvd():
    layout = PromptLayout((1, 5, 6), CHUNKS, SUFFIX)
    assert plan(Mode.CACHEBLEND).selection is Selection.HKVD
    chosen = plan_prefill(layout, Mode.CACHEBLEND, (True,) * 3, True, 0.15, (1,), Selection.RANDOM)
    assert chosen.selection is Selection.RANDOM
