"""LayerOps, the decoder's ops on token subsets: run on all tokens it is the model's own
forward, and a subset of queries attends exactly as those rows of the full pass."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from demo.tiny import FAMILIES
from engine.model.attention import ATTENTION_BLOCK, MIN_CAUSAL_RUN, query_spans
from engine.model.layers import LayerOps
from tests.engine.hf_reference import cache_keyword

TOKENS = list(range(5, 45))


def full_pass(ops: LayerOps, token_ids: list[int], queries: list[int] | None = None):
    """Hidden states of `queries` (default: all) after every layer, all keys computed exactly."""
    n = len(token_ids)
    queries = list(range(n)) if queries is None else queries
    cos, sin = ops.rope_tables(n)
    h = ops.embed(torch.tensor(token_ids))
    for i in range(ops.shape.num_layers):
        q, k, v = ops.project_qkv(i, h)
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        out = ops.attend(i, q[:, queries], k, v, ops.attention_plan(queries))
        h_all = h.clone()
        h_all[queries] = ops.finish_layer(i, h[queries], out)
        h = h_all
    return h[queries]


@pytest.mark.parametrize("family", FAMILIES)
def test_all_layers_on_all_tokens_give_the_models_own_last_logits(engine_for, family):
    engine = engine_for(family)
    ops = LayerOps(engine.model)
    with torch.inference_mode():
        ours = ops.logits(full_pass(ops, TOKENS)[-1])
        cache = DynamicCache(config=engine.model.config)
        theirs = (
            engine.model(
                torch.tensor([TOKENS]), use_cache=True, **{cache_keyword(engine.model): cache}
            )
            .logits[0, -1]
            .float()
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_query_subset_attends_exactly_as_those_rows_of_the_causal_pass(engine_for):
    ops = LayerOps(engine_for("llama").model)
    n = len(TOKENS)
    cos, sin = ops.rope_tables(n)
    with torch.inference_mode():
        h = ops.embed(torch.tensor(TOKENS))
        q, k, v = ops.project_qkv(0, h)
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        everyone = ops.attend(0, q, k, v, ops.attention_plan(list(range(n))))
        queries = [0, 3, 17, 18, 39]
        subset = ops.attend(0, q[:, queries], k, v, ops.attention_plan(queries))
    torch.testing.assert_close(subset, everyone[queries], rtol=1e-5, atol=1e-5)


def test_a_query_never_sees_a_later_position(engine_for):
    ops = LayerOps(engine_for("llama").model)
    n = len(TOKENS)
    cos, sin = ops.rope_tables(n)
    with torch.inference_mode():
        q, k, v = ops.project_qkv(0, ops.embed(torch.tensor(TOKENS)))
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        queries = [4, 10]
        plan = ops.attention_plan(queries)
        before = ops.attend(0, q[:, queries], k, v, plan)
        v_later = v.clone()
        v_later[:, 11:] = 1e3  # changes only values after the last query
        after = ops.attend(0, q[:, queries], k, v_later, plan)
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_scattered_queries_go_in_masked_blocks_that_need_keys_up_to_their_last_query():
    queries = list(range(0, 3 * ATTENTION_BLOCK, 2))  # 1.5 blocks of scattered positions
    spans = query_spans(queries)
    assert [(s.start, s.end, s.causal) for s in spans] == [
        (0, ATTENTION_BLOCK, False),
        (ATTENTION_BLOCK, len(queries), False),
    ]
    assert [s.key_end for s in spans] == [queries[ATTENTION_BLOCK - 1] + 1, queries[-1] + 1]
    assert query_spans([]) == []


def test_a_long_run_from_near_the_start_is_causal_and_a_late_or_short_one_is_masked():
    tail = list(range(100, 100 + 4 * MIN_CAUSAL_RUN))  # starts 100 in, runs 256 long
    late = list(range(5000, 5000 + 4 * MIN_CAUSAL_RUN))
    short = list(range(10, 10 + MIN_CAUSAL_RUN - 1))
    assert [(s.causal, s.key_end) for s in query_spans([3, 7, *tail])] == [
        (False, 8),
        (True, tail[-1] + 1),
    ]
    assert not any(s.causal for s in query_spans(late))
    assert not any(s.causal for s in query_spans(short))


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_runs_attend_exactly_as_the_masked_blocks(engine_for, family, monkeypatch):
    """A run of queries behind a few scattered ones (r = 1 behind a cached prefix, an uncached
    chunk, the suffix): the causal kernel gives what the masked path gives, window included."""
    ops = LayerOps(engine_for(family).model)
    n = 3 * MIN_CAUSAL_RUN
    token_ids = [5 + t % 40 for t in range(n)]
    queries = [1, 4, *range(9, n)]
    cos, sin = ops.rope_tables(n)
    with torch.inference_mode():
        q, k, v = ops.project_qkv(0, ops.embed(torch.tensor(token_ids)))
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        causal_plan = ops.attention_plan(queries)
        assert any(span.causal for span in causal_plan.spans)
        fast = [ops.attend(i, q[:, queries], k, v, causal_plan) for i in (0, 1)]
        monkeypatch.setattr("engine.model.attention.MIN_CAUSAL_RUN", n + 1)
        masked_plan = ops.attention_plan(queries)
        assert not any(span.causal for span in masked_plan.spans)
        masked = [ops.attend(i, q[:, queries], k, v, masked_plan) for i in (0, 1)]
    for ours, reference in zip(fast, masked, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_rotate_is_the_models_own_rope(engine_for):
    engine = engine_for("llama3")
    ops = LayerOps(engine.model)
    rope = __import__(type(ops.blocks[0].self_attn).__module__, fromlist=["x"])
    cos, sin = ops.rope_tables(7)
    x = torch.randn(2, 7, ops.shape.head_dim)
    expected, _ = rope.apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    torch.testing.assert_close(ops.rotate(x, cos, sin), expected[0])
