"""The controller over a real engine and store: it leaves a fallback as soon as the tier is fast
again, catches a tier that slows down within one request, and its fallback reuses the cached
prefix."""

from __future__ import annotations

import pytest
import torch

from engine.blend.dense import run_to_end
from engine.blend.layout import PromptLayout
from engine.blend.plan import ChunkSource
from engine.blend.prefill import Prefill, PrefillAsk
from engine.engine import Engine
from engine.model.load import load_model
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
    """Tokens a full prefill of `layout` computes: all but the cached prefix."""
    return layout.num_tokens - len(layout.prefix)


def prefill_at(engine: Engine, layout: PromptLayout, layer_compute_s: float) -> Prefill:
    """Prefill `layout` with the controller's compute estimate set to `layer_compute_s` per
    layer: its decisions then depend on the measured loads alone, not on this machine's load."""
    controller = engine.prefiller.controller
    controller.token_layer_s = layer_compute_s / computed_tokens(engine, layout)
    return run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.CACHEBLEND)))


@pytest.mark.parametrize("engine", [tiers.MEMORY, tiers.SSD], indirect=True)
def test_one_slow_first_read_then_fast_reads_resume_blending_by_the_third_request(engine, chunks):
    layout = engine.layout(ask(chunks))
    engine.prefiller.kv_read_delay_s = 0.15  # the first request reads 150 ms per layer
    first = prefill_at(engine, layout, layer_compute_s=0.03)
    assert first.blend.chosen_by == "controller" and not first.blend.fell_back_to_full_prefill
    assert set(first.chunk_tiers) == {
        tiers.MEMORY if engine.store.tier(tiers.SSD) is None else tiers.SSD
    }

    engine.prefiller.kv_read_delay_s = 0.0
    later = [prefill_at(engine, layout, layer_compute_s=0.03) for _ in range(6)]  # requests 2-7
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
    full = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.FULL_PREFILL)))

    assert fallback.blend.fell_back_to_full_prefill
    assert fallback.plan.prefix_cached
    assert fallback.plan.chunk_sources == (ChunkSource.COMPUTE,) * 3
    assert fallback.usage.cached_tokens == len(layout.prefix) > 0
    assert fallback.usage.recomputed_tokens == sum(len(c) for c in layout.chunks)
    assert full.usage.cached_tokens == 0
    torch.testing.assert_close(fallback.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(fallback.output.keys, full.output.keys, rtol=RTOL, atol=ATOL)


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
    assert loaded == list(range(check_layer, engine.ops.shape.num_layers))
