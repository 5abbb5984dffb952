"""The engine over the SSD tier: bad entries are counted misses that get recomputed, and
loading layer i+1 overlaps computing layer i."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from engine.blend.plan import ChunkSource
from engine.engine import Engine
from engine.model.load import load_model
from engine.types import GenerateRequest, Mode
from kvstore import format as kvformat
from kvstore import tiers
from kvstore.store import KVStore, KVStoreConfig

RATIO = 0.5


def ssd_engine(path, store_dir, **options) -> Engine:
    loaded = load_model(path)
    store = KVStore(
        KVStoreConfig(
            model_fingerprint=loaded.fingerprint, memory_budget_bytes=0, ssd_path=store_dir
        )
    )
    return Engine(loaded, store, **options)


def request(chunks) -> GenerateRequest:
    return GenerateRequest(
        question="what does kalo hold?", chunks=chunks, max_tokens=8, recompute_ratio=RATIO
    )


def flip_a_byte_of_the_last_layer(engine, key) -> None:
    path = engine.store.tier(tiers.SSD).file_path(key)
    header = kvformat.parse_header(path.read_bytes(), engine.fingerprint, key)
    offset = header.layer_offset(header.num_layers - 1) + 3
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def truncate(engine, key) -> None:
    path = engine.store.tier(tiers.SSD).file_path(key)
    os.truncate(path, os.path.getsize(path) // 2)


def wrong_version(engine, key) -> None:
    with open(engine.store.tier(tiers.SSD).file_path(key), "r+b") as f:
        f.seek(8)  # after the 8-byte magic
        f.write(struct.pack("<I", 99))


def warm_prefix(engine: Engine) -> None:
    """Fill the prefix cache, so that compared runs take the same path."""
    engine.prefill(GenerateRequest(question="warm up"))


@pytest.fixture
def reference(checkpoint_dir, make_chunks):
    """Logits and text when the damaged chunk was never cached at all."""
    chunks = make_chunks(3, seed=51)
    engine = Engine.from_pretrained(checkpoint_dir("llama"))
    engine.precompute([chunks[0], chunks[2]])
    warm_prefix(engine)
    prefill = engine.prefill(request(chunks))
    assert prefill.plan.chunk_sources[1] is ChunkSource.COMPUTE
    yield chunks, prefill.output.logits, engine.generate(request(chunks)).text
    engine.close()


@pytest.mark.parametrize("damage", [flip_a_byte_of_the_last_layer, truncate, wrong_version])
def test_a_bad_ssd_entry_is_a_counted_miss_then_recomputed_with_the_right_answer(
    checkpoint_dir, tmp_path, reference, damage
):
    chunks, expected_logits, expected_text = reference
    engine = ssd_engine(checkpoint_dir("llama"), tmp_path / "kv")
    engine.precompute(chunks)
    engine.store.flush()
    warm_prefix(engine)
    key = engine.chunk_key(engine.prompts.chunk_tokens(chunks[1].text))
    damage(engine, key)

    prefill = engine.prefill(request(chunks))
    assert engine.store.stats().tiers[tiers.SSD].corrupt == 1
    assert prefill.plan.chunk_sources[1] is ChunkSource.COMPUTE
    torch.testing.assert_close(prefill.output.logits, expected_logits, rtol=1e-4, atol=1e-5)
    assert engine.generate(request(chunks)).text == expected_text

    engine.drain()  # the write-back recomputed the entry in the background
    engine.store.flush()
    assert engine.store.lookup([key])[0] is not None
    engine.close()
    engine.store.close()


def test_an_entry_of_another_model_is_a_counted_miss_then_recomputed(
    checkpoint_dir, tmp_path, reference
):
    from demo.tiny import save_random_checkpoint

    chunks, expected_logits, _ = reference
    other_path = save_random_checkpoint(
        "llama", tmp_path / "other", seed=9, initializer_range=0.1, max_positions=1024
    )
    other = ssd_engine(str(other_path), tmp_path / "other-kv")
    other.precompute([chunks[1]])
    other.store.flush()
    engine = ssd_engine(checkpoint_dir("llama"), tmp_path / "kv")
    engine.precompute(chunks)
    engine.store.flush()
    tokens = engine.prompts.chunk_tokens(chunks[1].text)
    os.replace(
        other.store.tier(tiers.SSD).file_path(other.chunk_key(tokens)),
        engine.store.tier(tiers.SSD).file_path(engine.chunk_key(tokens)),
    )
    engine.close()
    engine.store.close()

    restarted = ssd_engine(checkpoint_dir("llama"), tmp_path / "kv")
    assert restarted.store.stats().tiers[tiers.SSD].corrupt == 1
    warm_prefix(restarted)
    prefill = restarted.prefill(request(chunks))
    assert prefill.plan.chunk_sources[1] is ChunkSource.COMPUTE
    torch.testing.assert_close(prefill.output.logits, expected_logits, rtol=1e-4, atol=1e-5)
    for e in (other, restarted):
        e.close()
        e.store.close()


def test_loading_layer_i_plus_1_overlaps_computing_layer_i(checkpoint_dir, tmp_path, make_chunks):
    engine = ssd_engine(checkpoint_dir("qwen3"), tmp_path / "kv", kv_read_delay_s=0.05)
    chunks = make_chunks(3, seed=53)
    engine.precompute(chunks)
    engine.store.flush()
    result = engine.generate(request(chunks))
    layers = result.layers
    loaded = [e for e in layers if e.load_start_s is not None]
    assert len(loaded) >= 3
    for current, following in zip(layers, layers[1:], strict=False):
        if following.load_end_s is not None:
            assert current.compute_start_s < following.load_end_s, (current, following)
    assert 0.0 < result.timings.overlap <= 1.0
    assert result.chunk_tiers == ["ssd", "ssd", "ssd"]
    assert result.load_bytes_by_tier["ssd"] > 0
    engine.close()
    engine.store.close()


def test_the_controller_falls_back_to_full_prefill_when_loads_are_slower_than_compute(
    checkpoint_dir, tmp_path, make_chunks
):
    engine = ssd_engine(checkpoint_dir("llama"), tmp_path / "kv", kv_read_delay_s=0.3)
    chunks = make_chunks(3, seed=57)
    engine.precompute(chunks)
    engine.store.flush()
    warm_prefix(engine)
    controlled = GenerateRequest(question="what does kalo hold?", chunks=chunks, max_tokens=4)
    first = engine.generate(controlled)  # blends, and measures how slow this tier is
    assert first.blend.chosen_by == "controller" and not first.blend.fell_back_to_full_prefill
    assert first.load_bytes_by_tier["ssd"] > 0

    second = engine.prefill(controlled)
    assert second.blend.fell_back_to_full_prefill
    assert second.load_bytes_by_tier == {}  # nothing was waited for
    full = engine.prefill(GenerateRequest(**{**vars(controlled), "mode": Mode.FULL_PREFILL}))
    torch.testing.assert_close(second.output.logits, full.output.logits, rtol=1e-4, atol=1e-5)
    engine.close()
    engine.store.close()


@pytest.mark.parametrize("mode", [Mode.CACHEBLEND, Mode.FULL_REUSE])
def test_served_over_staged_layers_from_memory_and_ssd_the_answer_is_the_direct_one(
    checkpoint_dir, tmp_path, make_chunks, mode
):
    """Each layer's chunks, two in host memory and two on SSD (int8), packed through the staging
    slot as on a GPU, while the engine thread computes: the served answer is the direct one."""
    loaded = load_model(checkpoint_dir("llama"))
    config = KVStoreConfig(
        model_fingerprint=loaded.fingerprint,
        ssd_path=tmp_path / "kv",
        persistent_encoding="int8",
        stage_kv=True,
    )
    with KVStore(config) as store:
        engine = Engine(loaded, store)
        try:
            chunks = make_chunks(4, seed=53)
            engine.precompute(chunks)
            store.flush()
            for chunk in chunks[1::2]:  # every other one read back from SSD, compressed
                store.tier(tiers.MEMORY).discard(
                    engine.chunk_key(engine.prompts.chunk_tokens(chunk.text))
                )
            warm_prefix(engine)
            asked = GenerateRequest(
                question="what does kalo hold?", chunks=chunks, max_tokens=1, mode=mode
            )
            direct = engine.prefill(asked)
            store.flush()  # its reads promoted the SSD entries: back to SSD only
            for chunk in chunks[1::2]:
                store.tier(tiers.MEMORY).discard(
                    engine.chunk_key(engine.prompts.chunk_tokens(chunk.text))
                )
            served = engine.generate(asked)
            assert direct.chunk_tiers == served.chunk_tiers == ["memory", "ssd"] * 2
            assert served.token_ids[0] == int(direct.output.logits.argmax())
        finally:
            engine.close()
