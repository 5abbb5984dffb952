"""The controller over a real engine and store: it leaves a fallback as soon as the tier is fast
again, catches a tier that slows down within one request, and its fallback reuses exact KV."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.model import load_model
from engine.plan import ChunkSource
from engine.prefill import Prefill
from engine.prompt import PromptLayout
from engine.types import GenerateRequest, Mode
from kvstore import tiers
from kvstore.store import KVStore, KVStoreConfig

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture
def engine(request, checkpoint_dir, tmp_path):
    """An engine whose chunk KV lives in host memory, or (param tiers.SSD) on SSD only."""
    loaded = load_model(checkpoint_dir("llama"))
    config = KVStoreConfig(model_fingerprint=loaded.fingerprint)
    if getattr(request, "param", tiers.MEMORY) == tiers.SSD:
        config = KVStoreConfig(
            model_fingerprint=loaded.fingerprint, memory_budget_bytes=0, ssd_path=tmp_path / "kv"
        )
    engine = Engine(loaded, KVStore(config))
    yield engine
    engine.close()
    engine.store.close()


@pytest.fixture
def chunks(engine, make_chunks):
    chunks = make_chunks(3, seed=61)
    engine.precompute(chunks)
    engine.store.flush()
    engine.prefill(GenerateRequest(question="warm up"))  # the prompt prefix, cached
    return chunks


def ask(chunks, **options) -> GenerateRequest:
    return GenerateRequest(question="what does kalo hold?", chunks=chunks, **options)


def computed_tokens(engine: Engine, layout: PromptLayout) -> int:
    """Tokens a full prefill of `layout` computes: all but the cached prefix and exact chunk."""
    exact = layout.chunks[0] if layout.prefix == engine.prompts.chunk_prefix else ()
    return layout.num_tokens - len(layout.prefix) - len(exact)


def prefill_at(engine: Engine, layout: PromptLayout, layer_compute_s: float) -> Prefill:
    """Prefill `layout` with the controller's compute estimate set to `layer_compute_s` per
    layer: its decisions then depend on the measured loads alone, not on this machine's load."""
    controller = engine.prefiller.controller
    controller.token_layer_s = layer_compute_s / computed_tokens(engine, layout)
    return engine.prefill_layout(layout, Mode.CACHEBLEND)


@pytest.mark.parametrize("engine", [tiers.MEMORY, tiers.SSD], indirect=True)
def test_one_slow_first_read_then_fast_reads_resume_blending_by_the_third_request(engine, chunks):
    layout = engine.layout(ask(chunks))
    engine.prefiller.kv_read_delay_s = 0.05  # the first request reads 50 ms per layer
    first = prefill_at(engine, layout, layer_compute_s=0.01)
    assert first.blend.chosen_by == "controller" and not first.blend.fell_back_to_full_prefill
    assert set(first.chunk_tiers) == {
        tiers.MEMORY if engine.store.tier(tiers.SSD) is None else tiers.SSD
    }

    engine.prefiller.kv_read_delay_s = 0.0
    later = [prefill_at(engine, layout, layer_compute_s=0.01) for _ in range(6)]  # requests 2-7
    # Request 2 still believes the tier is slow, but its probe measures it fast.
    assert later[0].blend.fell_back_to_full_prefill
    assert [p.blend.fell_back_to_full_prefill for p in later[1:]] == [False] * 5
    assert all(p.plan.chunk_sources == (ChunkSource.BLEND,) * 3 for p in later[1:])


@pytest.mark.parametrize("engine", [tiers.MEMORY, tiers.SSD], indirect=True)
def test_a_tier_that_slows_100x_is_caught_by_the_next_request(engine, chunks):
    layout = engine.layout(ask(chunks))
    # Loads 1 ms per layer against 40 ms of compute. An average of the 100x slower read with
    # weight 0.3 (0.7 * 1 + 0.3 * 100 = 30.7 ms) would still blend on a tier 2.5x too slow.
    engine.prefiller.kv_read_delay_s = 0.001
    for _ in range(3):
        assert not prefill_at(engine, layout, 0.04).blend.fell_back_to_full_prefill

    engine.prefiller.kv_read_delay_s = 0.1
    slowed = prefill_at(engine, layout, 0.04)  # blends, and measures 100 ms per layer
    assert not slowed.blend.fell_back_to_full_prefill
    caught = prefill_at(engine, layout, 0.04)
    assert caught.blend.fell_back_to_full_prefill
    assert caught.load_bytes_by_tier == {}  # the request waited for no load
    # Its probe finished no layer during the compute, or found it as slow: still a fallback.
    assert prefill_at(engine, layout, 0.04).blend.fell_back_to_full_prefill


def test_the_fallback_reuses_the_cached_prefix_and_equals_full_prefill(engine, chunks):
    layout = engine.layout(ask(chunks))
    engine.prefiller.controller.seconds_per_byte[tiers.MEMORY] = 1.0  # a second per byte
    fallback = prefill_at(engine, layout, 0.01)
    full = engine.prefill_layout(layout, Mode.FULL_PREFILL)

    assert fallback.blend.fell_back_to_full_prefill
    assert fallback.plan.prefix_cached
    assert fallback.plan.chunk_sources == (ChunkSource.COMPUTE,) * 3
    assert fallback.usage.cached_tokens == len(layout.prefix) > 0
    assert fallback.usage.recomputed_tokens == sum(len(c) for c in layout.chunks)
    assert full.usage.cached_tokens == 0
    torch.testing.assert_close(fallback.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(fallback.output.keys, full.output.keys, rtol=RTOL, atol=ATOL)


def test_the_fallback_loads_an_exact_first_chunk_only_when_its_load_is_hidden(engine, chunks):
    tokens = tuple(engine.prompts.chunk_tokens(c.text) for c in chunks)
    layout = PromptLayout(engine.prompts.chunk_prefix, tokens, engine.prompts.encode("Answer:"))
    engine.prefill_layout(layout, Mode.PREFIX_CACHE)  # caches the prefix of this layout
    full = engine.prefill_layout(layout, Mode.FULL_PREFILL)
    controller = engine.prefiller.controller
    shape = engine.layers.shape
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * engine.layers.dtype.itemsize
    layer_compute_s = 0.01
    all_bytes = token_bytes * sum(len(t) for t in tokens)
    first_bytes = token_bytes * len(tokens[0])
    assert first_bytes < all_bytes / 2

    # The three chunks load in twice the compute of a layer; the first alone, in less.
    controller.seconds_per_byte[tiers.MEMORY] = 2 * layer_compute_s / all_bytes
    hidden = prefill_at(engine, layout, layer_compute_s)
    assert hidden.blend.fell_back_to_full_prefill
    assert hidden.plan.chunk_sources == (
        ChunkSource.EXACT,
        ChunkSource.COMPUTE,
        ChunkSource.COMPUTE,
    )
    assert hidden.usage.cached_tokens == len(layout.prefix) + len(tokens[0])
    assert hidden.load_bytes_by_tier[tiers.MEMORY] == first_bytes * shape.num_layers
    torch.testing.assert_close(hidden.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)

    # The first chunk alone loads slower than the rest computes: it is computed too.
    controller.seconds_per_byte[tiers.MEMORY] = 2 * layer_compute_s / first_bytes
    slow = prefill_at(engine, layout, layer_compute_s)
    assert slow.blend.fell_back_to_full_prefill
    assert slow.plan.chunk_sources == (ChunkSource.COMPUTE,) * 3
    assert slow.usage.cached_tokens == len(layout.prefix)
    torch.testing.assert_close(slow.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("check_layer", [1, 2])
def test_the_loader_reads_no_layer_below_the_first_check_layer(
    engine_for, make_chunks, check_layer
):
    engine = engine_for("llama", (check_layer,))
    chunks = make_chunks(3, seed=67)
    engine.precompute(chunks)
    blended = engine.prefill(ask(chunks, recompute_ratio=0.3))
    assert blended.plan.chunk_sources == (ChunkSource.BLEND,) * 3
    loaded = [e.layer for e in blended.timeline if e.load_start_s is not None]
    assert loaded == list(range(check_layer, engine.layers.shape.num_layers))


def test_an_exact_first_chunk_is_read_from_layer_0(engine, chunks):
    tokens = tuple(engine.prompts.chunk_tokens(c.text) for c in chunks)
    layout = PromptLayout(engine.prompts.chunk_prefix, tokens, engine.prompts.encode("Answer:"))
    exact = engine.prefill_layout(layout, Mode.CACHEBLEND, 0.3)
    assert exact.plan.chunk_sources[0] is ChunkSource.EXACT
    assert [e.layer for e in exact.timeline if e.load_start_s is not None][0] == 0
