"""The prefill's recovery from a chunk entry that turns out bad mid-stream: the chunk is computed
instead, on a fresh stream, whether the first stream was opened by the prefill or ahead of it."""

from __future__ import annotations

import os

import pytest
import torch

from engine.blend.dense import run_to_end
from engine.blend.plan import ChunkSource
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.model.load import load_model
from engine.types import GenerateRequest, Mode
from kvstore import format as kvformat
from kvstore import tiers
from kvstore.store import KVStore, KVStoreConfig
from tests.kvstore.kv_testutil import flip_byte

RTOL, ATOL = 1e-4, 1e-5
BAD_LAYER = 2  # past the first check layer, so the stream has delivered layers before it


@pytest.fixture
def engine(checkpoint_dir, tmp_path):
    """An engine whose chunk KV lives on SSD only, so that a damaged file is what it reads."""
    loaded = load_model(checkpoint_dir("llama"))
    store = KVStore(
        KVStoreConfig(
            model_fingerprint=loaded.fingerprint, memory_budget_bytes=0, ssd_path=tmp_path / "kv"
        )
    )
    engine = Engine(loaded, store)
    yield engine
    engine.close()
    store.close()


def damage(engine: Engine, tokens: tuple[int, ...], how: str) -> None:
    """Flip a byte inside one layer of the chunk's SSD entry, or cut the file there."""
    key = engine.chunk_key(tokens)
    ssd = engine.store.tier(tiers.SSD)
    assert ssd is not None
    path = ssd.file_path(key)
    header = kvformat.parse_header(path.read_bytes(), engine.fingerprint, key)
    offset = header.layer_offset(BAD_LAYER) + 10
    if how == "corrupt":
        flip_byte(path, offset)
    else:
        os.truncate(path, offset)


@pytest.mark.parametrize("how", ["corrupt", "truncated"])
@pytest.mark.parametrize("ahead", [False, True], ids=["own-stream", "opened-ahead"])
def test_a_chunk_entry_bad_mid_stream_is_recomputed_on_a_fresh_stream(
    engine, make_chunks, how, ahead
):
    chunks = make_chunks(3, seed=83)
    engine.precompute(chunks)
    engine.store.flush()
    request = GenerateRequest(question="what does kalo hold?", chunks=chunks, recompute_ratio=0.3)
    layout = engine.layout(request)
    opened = None
    if ahead:
        # Opened while the entry is whole, damaged before the loader (slowed) reaches it.
        engine.prefiller.kv_read_delay_s = 0.2
        opened = engine.prefiller.open_ahead(layout, PrefillAsk(Mode.CACHEBLEND, 0.3))
        assert opened is not None and opened.present == [True, True, True]
    damage(engine, layout.chunks[1], how)
    recovered = run_to_end(
        engine.prefiller.prefill(layout, PrefillAsk(Mode.CACHEBLEND, 0.3), opened=opened)
    )

    sources = (ChunkSource.BLEND, ChunkSource.COMPUTE, ChunkSource.BLEND)
    assert recovered.plan.chunk_sources == sources
    assert recovered.missing_chunks == [(layout.chunks[1], "")]
    assert engine.store.lookup([engine.chunk_key(c) for c in layout.chunks])[1] is None
    engine.prefiller.kv_read_delay_s = 0.0
    # The same as a prefill that never had the entry: nothing of the bad read is left.
    again = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.CACHEBLEND, 0.3)))
    assert again.plan.chunk_sources == sources
    torch.testing.assert_close(recovered.output.logits, again.output.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(recovered.output.keys, again.output.keys, rtol=RTOL, atol=ATOL)


def test_a_request_whose_chunk_entry_is_bad_mid_stream_is_answered(engine, make_chunks):
    chunks = make_chunks(3, seed=89)
    engine.precompute(chunks)
    engine.store.flush()
    request = GenerateRequest(question="what does kalo hold?", chunks=chunks, max_tokens=3)
    damage(engine, engine.layout(request).chunks[0], "corrupt")
    result = engine.generate(request)
    assert result.finish_reason in ("length", "stop")
    assert result.usage.recomputed_tokens >= len(engine.layout(request).chunks[0])
