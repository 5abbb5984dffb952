"""Every selection in the blend loop, the auto ratio and the oracle's scores, on tiny float32
models: exact budgets, determinism per prompt, and full prefill at r = 1 on every family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.check import default_check_layers, default_selection
from engine.blend.dense import run_to_end
from engine.blend.loop import layer_loop
from engine.blend.plan import ChunkSource
from engine.blend.selection import Selection, token_deviation
from engine.engine import Engine
from engine.quality.oracle import Oracle, oracle_scores
from engine.types import Mode
from tests.engine.blend.test_blend import ATOL, RTOL, recomputed_positions, request

SELECTIONS = list(Selection)


def blended_tokens(prefill) -> int:
    return sum(length for _, length in prefill.layout.chunk_spans)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_selection_at_ratio_one_equals_full_prefill(
    engine_for, make_chunks, family, selection
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=61)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL)).output
    blended = engine.prefill(request(chunks, recompute_ratio=1.0, selection=selection))
    assert blended.plan.selection is selection
    assert blended.blend.selection == selection.value
    torch.testing.assert_close(blended.output.logits, full.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.keys, full.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(blended.output.values, full.values, rtol=RTOL, atol=ATOL)


# Not (1, 2, 3): on these 4-layer models the last layer would itself be a check layer.
@pytest.mark.parametrize("check_layers", [(1,), (1, 2)])
@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_selection_recomputes_exactly_its_budget(
    engine_for, make_chunks, check_layers, selection
):
    engine = engine_for("llama", check_layers)
    chunks = make_chunks(4, seed=67)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio=0.1, selection=selection))
    budget = -(-blended_tokens(prefill) // 10)
    assert prefill.usage.recomputed_tokens == budget
    assert len(recomputed_positions(engine, prefill)) == budget


@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_selection_is_deterministic_for_a_prompt(engine_for, make_chunks, selection):
    engine = engine_for("qwen2")
    chunks = make_chunks(4, seed=71)
    engine.precompute(chunks)
    first = engine.prefill(request(chunks, recompute_ratio=0.2, selection=selection))
    again = engine.prefill(request(chunks, recompute_ratio=0.2, selection=selection))
    assert recomputed_positions(engine, again) == recomputed_positions(engine, first)
    torch.testing.assert_close(again.output.logits, first.output.logits, rtol=0, atol=0)


def test_sink_recomputes_the_first_tokens_of_every_chunk(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(4, seed=73)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio=0.1, selection=Selection.SINK))
    spans = prefill.layout.chunk_spans
    budget = -(-blended_tokens(prefill) // 10)
    per_chunk, extra = divmod(budget, len(spans))
    expected = [
        start + offset
        for j, (start, _) in enumerate(spans)
        for offset in range(per_chunk + (j < extra))
    ]
    assert recomputed_positions(engine, prefill) == expected


def test_selections_that_rank_differently_pick_different_tokens(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(6, seed=79)
    engine.precompute(chunks)
    picks = {
        s: tuple(
            recomputed_positions(
                engine, engine.prefill(request(chunks, recompute_ratio=0.1, selection=s))
            )
        )
        for s in (Selection.HKVD, Selection.QUERY, Selection.SINK)
    }
    assert len(set(picks.values())) == 3


def test_auto_ratio_stays_within_its_bound_and_reports_what_it_chose(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(4, seed=83)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio="auto", max_recompute_ratio=0.4))
    blended = blended_tokens(prefill)
    recomputed = prefill.usage.recomputed_tokens
    assert 0 < recomputed <= -(-4 * blended // 10)
    assert prefill.blend.chosen_by == "auto"
    assert prefill.blend.recompute_ratio == pytest.approx(recomputed / blended)
    assert len(recomputed_positions(engine, prefill)) == recomputed


def test_auto_ratio_recomputes_more_for_a_larger_share_of_the_mass(checkpoint_dir, make_chunks):
    chunks = make_chunks(4, seed=89)
    counts = []
    for coverage in (0.2, 0.6, 1.0):
        engine = Engine.from_pretrained(
            checkpoint_dir("llama"), auto_coverage=coverage, auto_max_ratio=1.0
        )
        try:
            engine.precompute(chunks)
            prefill = engine.prefill(request(chunks, recompute_ratio="auto"))
            counts.append(prefill.usage.recomputed_tokens)
        finally:
            engine.close()
    # Covering the whole mass needs every token whose deviation is not zero: all of them.
    assert counts[0] < counts[1] < counts[2] == blended_tokens(prefill)


def test_token_scores_rank_the_tokens_instead_of_the_selection(engine_for, make_chunks):
    engine = engine_for("mistral")
    chunks = make_chunks(3, seed=97)
    engine.precompute(chunks)
    layout = engine.layout(request(chunks))
    blend_positions = [p for start, n in layout.chunk_spans for p in range(start, start + n)]
    wanted = blend_positions[3::7][:5]
    scores = tuple(1.0 if p in wanted else 0.0 for p in blend_positions)
    prefill = engine.prefill(
        request(chunks, recompute_ratio=len(wanted) / len(blend_positions)), scores
    )
    assert prefill.blend.selection == "oracle"
    assert recomputed_positions(engine, prefill) == wanted


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_oracle_deviation_is_the_full_prefills_kv_deviation_summed_over_layers(
    engine_for, make_chunks, family
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=101)
    engine.precompute(chunks)
    full = engine.prefill(request(chunks, mode=Mode.FULL_PREFILL))
    layout, plan = full.layout, dataclasses.replace(full.plan, keep_pre_rope_keys=True)
    output = run_to_end(layer_loop(engine.ops, plan))
    cached = [engine.prefiller.compute_chunk_kv(tokens) for tokens in layout.chunks]
    rows = torch.tensor([p for s, n in layout.chunk_spans for p in range(s, s + n)])
    expected = sum(
        token_deviation(
            output.pre_rope_keys[i][:, rows],
            torch.cat([c.keys[i] for c in cached], dim=1),
            output.values[i][:, rows],
            torch.cat([c.values[i] for c in cached], dim=1),
        )
        for i in range(engine.ops.shape.num_layers)
    )
    scores = oracle_scores(
        engine.ops, layout.token_ids, layout.chunk_spans, cached, plan.suffix_start
    )
    assert plan.chunk_sources == (ChunkSource.COMPUTE,) * 3
    torch.testing.assert_close(
        torch.tensor(scores.by_oracle[Oracle.DEVIATION]), expected, rtol=1e-4, atol=1e-5
    )
    attention = torch.tensor(scores.by_oracle[Oracle.ATTENTION])
    assert (attention >= 0).all() and float(attention.sum()) <= engine.ops.shape.num_layers


def test_default_check_layers_are_layer_one_and_a_quarter_of_the_depth():
    assert default_check_layers(30) == (1, 7)
    assert default_check_layers(32) == (1, 8)
    assert default_check_layers(8) == (1, 2)
    assert default_check_layers(4) == (1,)
    assert default_check_layers(1) == (0,)


def test_default_selection_weights_by_attention_only_with_a_deeper_last_check_layer():
    assert default_selection((1, 7)) is Selection.QUERY_HKVD
    assert default_selection((1,)) is Selection.HKVD
    assert default_selection((2, 2)) is Selection.HKVD


@pytest.mark.parametrize(
    ("check_layers", "expected"), [((1,), Selection.HKVD), ((1, 2), Selection.QUERY_HKVD)]
)
def test_an_engine_without_a_selection_uses_the_default_of_its_check_layers(
    engine_for, make_chunks, check_layers, expected
):
    engine = engine_for("llama", check_layers)
    chunks = make_chunks(3, seed=103)
    engine.precompute(chunks)
    prefill = engine.prefill(request(chunks, recompute_ratio=0.2))
    assert prefill.blend.selection == expected.value
    asked = engine.prefill(request(chunks, recompute_ratio=0.2, selection=Selection.SINK))
    assert asked.blend.selection == Selection.SINK.value
