"""The blend invariants (docs/design.md, "The layer loop"), on tiny float32 models of every
supported family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from demo.tiny import FAMILIES
from engine.blend.dense import run_to_end
from engine.blend.layout import PromptLayout
from engine.blend.plan import ChunkSource
from engine.blend.prefill import PrefillAsk
from engine.blend.selection import Selection
from engine.engine import Engine
from engine.types import GenerateRequest, Mode, Turn
from tests.engine.hf_reference import cache_keyword
from tests.kvstore.kv_testutil import read_entry

RTOL, ATOL = 1e-4, 1e-5


def hf_forward(engine, token_ids, cache: DynamicCache | None = None):
    """The model's own forward: last-position logits and the filled cache."""
    model = engine.model
    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(torch.tensor([token_ids]), use_cache=True, **{cache_keyword(model): cache})
    return out.logits[0, -1].float(), cache


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, max_tokens=6, **overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prefill_matches_the_models_own_forward(engine_for, make_chunks, family):
    engine = engine_for(family)
    prefill = engine.prefill(request(make_chunks(3), mode=Mode.FULL_PREFILL))
    logits, cache = hf_forward(engine, prefill.layout.token_ids)
    torch.testing.assert_close(prefill.output.logits, logits, rtol=RTOL, atol=ATOL)
    for i, layer in enumerate(cache.layers):
        kept = layer.keys.shape[2]  # a sliding-window layer keeps only the window
        torch.testing.assert_close(
            prefill.output.keys[i][:, -kept:], layer.keys[0], rtol=RTOL, atol=ATOL
        )
        torch.testing.assert_close(
            prefill.output.values[i][:, -kept:], layer.values[0], rtol=RTOL, atol=ATOL
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_chunks", [1, 3, 6])
def test_ratio_one_equals_full_prefill_logits_and_kv(engine_for, make_chunks, family, num_chunks):
    engine = engine_for(family)
    chunks = make_chunks(num_chunks, seed=num_chunks)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    blended = engine.prefill(request(chunks, recompute_ratio=1.0))
    assert blended.plan.chunk_sources == (ChunkSource.BLEND,) * num_chunks
    torch.testing.assert_close(blended.output.logits, full.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.keys, full.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.values, full.values, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_at_ratio_one_equals_full_prefill_of_the_same_prompt(
    engine_for, make_chunks, family
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=23)
    engine.precompute(chunks)
    history = (Turn("user", "where is kalo vo?"), Turn("assistant", "zuka tas pe drisol."))
    full = engine.prefill(request(chunks, history=history, mode=Mode.FULL_PREFILL))
    blended = engine.prefill(request(chunks, history=history, recompute_ratio=1.0))
    # The turns are suffix tokens, after the passages: the blend is unchanged around them.
    assert blended.layout.suffix != engine.prefill(request(chunks)).layout.suffix
    assert blended.layout.token_ids == full.layout.token_ids
    assert blended.plan.chunk_sources == (ChunkSource.BLEND,) * 3
    torch.testing.assert_close(blended.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.keys, full.output.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.values, full.output.values, rtol=RTOL, atol=ATOL)
    logits, _ = hf_forward(engine, full.layout.token_ids)
    torch.testing.assert_close(full.output.logits, logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", list(Mode))
def test_one_chunk_behind_the_bos_prefix_equals_full_prefill_in_every_mode(
    engine_for, make_chunks, family, mode
):
    engine = engine_for(family)
    (chunk,) = make_chunks(1, seed=7)
    engine.precompute([chunk])
    tokens = engine.prompts.chunk_tokens(chunk.text)
    layout = PromptLayout(engine.prompts.chunk_prefix, (tokens,), engine.prompts.encode("Answer:"))
    full = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.FULL_PREFILL, 1.0))).output
    reused = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode, 0.15)))
    if mode in (Mode.CACHEBLEND, Mode.FULL_REUSE):
        assert reused.plan.chunk_sources == (ChunkSource.BLEND,)
    torch.testing.assert_close(reused.output.logits, full.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(reused.output.keys, full.keys, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_rerotated_layer0_keys_equal_keys_computed_at_the_final_positions(
    engine_for, make_chunks, family
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=11)
    engine.precompute(chunks)
    reused = engine.prefill(request(chunks, mode=Mode.FULL_REUSE))
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    for start, length in reused.layout.chunk_spans:
        span = slice(start, start + length)
        torch.testing.assert_close(
            reused.output.keys[0][:, span], full.keys[0][:, span], rtol=RTOL, atol=ATOL
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_later_positions_never_change_earlier_outputs(engine_for, make_chunks, family):
    """Two questions after the same chunks: everything before the question is identical, so no
    recomputed chunk token saw a later position (a bottom-right mask would leak the question)."""
    engine = engine_for(family)
    chunks = make_chunks(3, seed=13)
    engine.precompute(chunks)
    first = engine.prefill(request(chunks, recompute_ratio=0.3))
    second = engine.prefill(
        dataclasses.replace(
            request(chunks, recompute_ratio=0.3), question="how many ka are there in the mi?"
        )
    )
    start, length = first.layout.chunk_spans[-1]
    end = start + length
    assert first.layout.token_ids[:end] == second.layout.token_ids[:end]
    assert first.output.num_selected > 0
    torch.testing.assert_close(
        first.output.keys[:, :, :end], second.output.keys[:, :, :end], rtol=RTOL, atol=ATOL
    )
    torch.testing.assert_close(
        first.output.values[:, :, :end], second.output.values[:, :, :end], rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_equals_naive_concatenation_of_chunk_caches(engine_for, make_chunks, family):
    engine = engine_for(family)
    model = engine.model
    chunks = make_chunks(3, seed=17)
    engine.precompute(chunks)
    blended = engine.prefill(request(chunks, recompute_ratio=0.0))
    layout = blended.layout
    assert blended.usage.recomputed_tokens == 0

    # The naive concatenation, built with the model's own RoPE code: exact prefix KV, then each
    # stored chunk rotated to its final positions.
    rope_module = __import__(type(model.model.layers[0].self_attn).__module__, fromlist=["x"])
    num_chunk_end = layout.chunk_spans[-1][0] + layout.chunk_spans[-1][1]
    positions = torch.arange(num_chunk_end)[None]
    cos, sin = model.model.rotary_emb(torch.empty(1, dtype=model.dtype), positions)
    _, prefix_cache = hf_forward(engine, layout.prefix)
    naive = DynamicCache()  # full layers: sliding-window layers would crop the comparison
    for i in range(len(model.model.layers)):
        keys, values = [prefix_cache.layers[i].keys], [prefix_cache.layers[i].values]
        for tokens, (start, length) in zip(layout.chunks, layout.chunk_spans, strict=True):
            stored = read_entry(engine.store, engine.chunk_key(tokens))
            k = stored.keys[i][None]
            rotated, _ = rope_module.apply_rotary_pos_emb(
                k, k, cos[:, start : start + length], sin[:, start : start + length]
            )
            keys.append(rotated)
            values.append(stored.values[i][None])
        naive.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), i)
    for i in range(len(model.model.layers)):
        torch.testing.assert_close(
            blended.output.keys[i][:, :num_chunk_end], naive.layers[i].keys[0], rtol=RTOL, atol=ATOL
        )
        torch.testing.assert_close(
            blended.output.values[i][:, :num_chunk_end],
            naive.layers[i].values[0],
            rtol=RTOL,
            atol=ATOL,
        )
    logits, _ = hf_forward(engine, list(layout.suffix), cache=naive)
    torch.testing.assert_close(blended.output.logits, logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_reuse_mode_is_ratio_zero(engine_for, make_chunks, family):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=19)
    engine.precompute(chunks)
    full_reuse = engine.prefill(request(chunks, mode=Mode.FULL_REUSE)).output
    ratio_zero = engine.prefill(request(chunks, recompute_ratio=0.0)).output
    torch.testing.assert_close(full_reuse.logits, ratio_zero.logits, rtol=0, atol=0)


def kv_deviation(a, b) -> float:
    return float((a.keys - b.keys).square().mean() + (a.values - b.values).square().mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_deviation_from_full_prefill_is_lower_at_half_than_at_zero(
    engine_for, make_chunks, family
):
    engine = engine_for(family)
    chunks = make_chunks(4, seed=23)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    at_zero = engine.prefill(request(chunks, recompute_ratio=0.0)).output
    at_half = engine.prefill(request(chunks, recompute_ratio=0.5)).output
    assert kv_deviation(at_half, full) < kv_deviation(at_zero, full)


def test_selection_recomputes_the_budgeted_number_of_tokens(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(4, seed=29)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio=0.15))
    num_chunk_tokens = sum(length for _, length in prefill.layout.chunk_spans)
    expected = -(-15 * num_chunk_tokens // 100)
    assert prefill.usage.recomputed_tokens == expected
    prefix_cached = prefill.plan.prefix_len if prefill.plan.prefix_cached else 0
    assert prefill.usage.cached_tokens == prefix_cached + num_chunk_tokens - expected


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gradual_narrowing_over_three_check_layers_keeps_the_invariants(
    engine_for, make_chunks, family
):
    engine = engine_for(family, check_layers=(1, 2, 3))
    chunks = make_chunks(3, seed=31)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    at_one = engine.prefill(request(chunks, recompute_ratio=1.0)).output
    torch.testing.assert_close(at_one.logits, full.logits, rtol=RTOL, atol=ATOL)
    narrowed = engine.prefill(request(chunks, recompute_ratio=0.1))
    num_chunk_tokens = sum(length for _, length in narrowed.layout.chunk_spans)
    assert narrowed.usage.recomputed_tokens == -(-num_chunk_tokens // 10)


def test_uncached_chunk_is_computed_in_full_and_written_back(engine_for, make_chunks):
    engine = engine_for("qwen2")
    cached, fresh = make_chunks(2, seed=37)
    engine.precompute([cached])
    fresh_key = engine.chunk_key(engine.prompts.chunk_tokens(fresh.text))
    assert engine.store.lookup([fresh_key]) == [None]

    prefill = engine.prefill(request((cached, fresh), recompute_ratio=0.0))
    assert prefill.plan.chunk_sources == (ChunkSource.BLEND, ChunkSource.COMPUTE)
    assert prefill.usage.recomputed_tokens == prefill.layout.chunk_spans[1][1]

    engine.generate(request((cached, fresh)))
    engine.drain()
    assert engine.store.lookup([fresh_key])[0] is not None
    stored = read_entry(engine.store, fresh_key)
    expected = engine.prefiller.compute_chunk_kv(engine.prompts.chunk_tokens(fresh.text))
    # The write-back ran in pieces between engine steps: other row blocks, so float32 rounding
    # (not the values) may differ from the chunk computed in one piece.
    torch.testing.assert_close(stored.keys, expected.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(stored.values, expected.values, rtol=RTOL, atol=ATOL)


def test_prefix_cache_mode_reuses_only_the_prompt_prefix(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(3, seed=41)
    engine.precompute(chunks)
    engine.prefill(request(chunks))  # fills the prefix cache
    prefill = engine.prefill(request(chunks, mode=Mode.PREFIX_CACHE))
    assert prefill.plan.prefix_cached
    assert prefill.plan.chunk_sources == (ChunkSource.COMPUTE,) * 3
    assert prefill.usage.cached_tokens == prefill.plan.prefix_len
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    torch.testing.assert_close(prefill.output.logits, full.logits, rtol=RTOL, atol=ATOL)


def test_empty_chunk_list_is_a_plain_prefill(engine_for):
    engine = engine_for("llama3")
    prefill = engine.prefill(request(()))
    logits, _ = hf_forward(engine, prefill.layout.token_ids)
    torch.testing.assert_close(prefill.output.logits, logits, rtol=RTOL, atol=ATOL)
    assert engine.generate(request(())).usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def random_engine_for(checkpoint_dir):
    """Engines that recompute a seeded random pick instead of the HKVD tokens."""
    engines: dict[tuple[str, tuple[int, ...]], Engine] = {}

    def get(family: str, check_layers: tuple[int, ...] = (1,)) -> Engine:
        if (family, check_layers) not in engines:
            engines[(family, check_layers)] = Engine.from_pretrained(
                checkpoint_dir(family), check_layers=check_layers, selection=Selection.RANDOM
            )
        return engines[(family, check_layers)]

    yield get
    for engine in engines.values():
        engine.close()


def recomputed_positions(engine, prefill) -> list[int]:
    """Blended chunk positions whose last-layer values differ from the chunk's cached values:
    the tokens recomputed through the last layer (the others keep the cached values as is)."""
    positions = []
    for tokens, (start, length) in zip(
        prefill.layout.chunks, prefill.layout.chunk_spans, strict=True
    ):
        cached = read_entry(engine.store, engine.chunk_key(tokens)).values[-1]
        blended = prefill.output.values[-1][:, start : start + length]
        changed = (blended != cached).any(dim=(0, 2))
        positions += [start + int(i) for i in changed.nonzero()[:, 0]]
    return positions


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("check_layers", [(1,), (1, 2, 3)])
def test_random_selection_at_ratio_one_equals_full_prefill(
    random_engine_for, make_chunks, family, check_layers
):
    engine = random_engine_for(family, check_layers)
    chunks = make_chunks(3, seed=43)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    blended = engine.prefill(request(chunks, recompute_ratio=1.0))
    assert blended.plan.selection is Selection.RANDOM
    torch.testing.assert_close(blended.output.logits, full.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.keys, full.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.values, full.values, rtol=RTOL, atol=ATOL)


# Not (1, 2, 3): on these 4-layer models the last layer would itself be a check layer, whose
# K/V is computed for the wider selection before narrowing.
@pytest.mark.parametrize("check_layers", [(1,), (1, 2)])
def test_random_selection_recomputes_exactly_the_budget(
    random_engine_for, make_chunks, check_layers
):
    engine = random_engine_for("llama", check_layers)
    chunks = make_chunks(4, seed=47)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio=0.1))
    budget = -(-sum(length for _, length in prefill.layout.chunk_spans) // 10)
    assert prefill.usage.recomputed_tokens == budget
    assert len(recomputed_positions(engine, prefill)) == budget


def test_random_selection_is_deterministic_per_prompt(random_engine_for, make_chunks):
    engine = random_engine_for("llama")
    chunks = make_chunks(4, seed=53)
    engine.precompute(chunks)
    first = engine.prefill(request(chunks, recompute_ratio=0.1))
    again = engine.prefill(request(chunks, recompute_ratio=0.1))
    picked = recomputed_positions(engine, first)
    assert recomputed_positions(engine, again) == picked
    torch.testing.assert_close(again.output.logits, first.output.logits, rtol=0, atol=0)
    other = engine.prefill(
        dataclasses.replace(request(chunks, recompute_ratio=0.1), question="where is vo zuka?")
    )
    assert len(recomputed_positions(engine, other)) == len(picked)
    assert recomputed_positions(engine, other) != picked


def test_random_and_hkvd_recompute_different_tokens_of_the_same_budget(
    engine_for, random_engine_for, make_chunks
):
    # 8 of ~150 blended tokens: a uniform pick equals the 8 most deviating with odds ~1e-12.
    chunks = make_chunks(6, seed=59)
    picks = {}
    for name, engine in (("hkvd", engine_for("llama")), ("random", random_engine_for("llama"))):
        engine.precompute(chunks)
        prefill = engine.prefill(request(chunks, recompute_ratio=0.05))
        picks[name] = recomputed_positions(engine, prefill)
    assert len(picks["hkvd"]) == len(picks["random"]) > 0
    assert picks["hkvd"] != picks["random"]
