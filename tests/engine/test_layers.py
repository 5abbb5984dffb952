"""LayerRunner, the decoder's ops on token subsets: run on all tokens it is the model's own
forward, and a subset of queries attends exactly as those rows of the full pass."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from demo.tiny import FAMILIES
from engine.layers import ATTENTION_BLOCK, LayerRunner
from tests.engine.hf_reference import cache_keyword

TOKENS = list(range(5, 45))


def full_pass(runner: LayerRunner, token_ids: list[int], queries: list[int] | None = None):
    """Hidden states of `queries` (default: all) after every layer, all keys computed exactly."""
    n = len(token_ids)
    queries = list(range(n)) if queries is None else queries
    cos, sin = runner.rope_tables(n)
    h = runner.embed(torch.tensor(token_ids))
    for i in range(runner.shape.num_layers):
        q, k, v = runner.project_qkv(i, h)
        q, k = runner.rotate(q, cos, sin), runner.rotate(k, cos, sin)
        positions = torch.tensor(queries)
        out = runner.attend(i, q[:, queries], k, v, positions, runner.attention_blocks(queries))
        h_all = h.clone()
        h_all[queries] = runner.finish_layer(i, h[queries], out)
        h = h_all
    return h[queries]


@pytest.mark.parametrize("family", FAMILIES)
def test_all_layers_on_all_tokens_give_the_models_own_last_logits(engine_for, family):
    engine = engine_for(family)
    runner = LayerRunner(engine.model)
    with torch.inference_mode():
        ours = runner.logits(full_pass(runner, TOKENS)[-1])
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
    runner = LayerRunner(engine_for("llama").model)
    n = len(TOKENS)
    cos, sin = runner.rope_tables(n)
    with torch.inference_mode():
        h = runner.embed(torch.tensor(TOKENS))
        q, k, v = runner.project_qkv(0, h)
        q, k = runner.rotate(q, cos, sin), runner.rotate(k, cos, sin)
        everyone = runner.attend(
            0, q, k, v, torch.arange(n), runner.attention_blocks(list(range(n)))
        )
        queries = [0, 3, 17, 18, 39]
        subset = runner.attend(
            0, q[:, queries], k, v, torch.tensor(queries), runner.attention_blocks(queries)
        )
    torch.testing.assert_close(subset, everyone[queries], rtol=1e-5, atol=1e-5)


def test_a_query_never_sees_a_later_position(engine_for):
    runner = LayerRunner(engine_for("llama").model)
    n = len(TOKENS)
    cos, sin = runner.rope_tables(n)
    with torch.inference_mode():
        q, k, v = runner.project_qkv(0, runner.embed(torch.tensor(TOKENS)))
        q, k = runner.rotate(q, cos, sin), runner.rotate(k, cos, sin)
        queries = [4, 10]
        before = runner.attend(0, q[:, queries], k, v, torch.tensor(queries), [(0, 2, n)])
        v_later = v.clone()
        v_later[:, 11:] = 1e3  # changes only values after the last query
        after = runner.attend(0, q[:, queries], k, v_later, torch.tensor(queries), [(0, 2, n)])
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_attention_blocks_split_queries_and_need_keys_up_to_each_blocks_last_query(engine_for):
    runner_blocks = LayerRunner(engine_for("llama").model).attention_blocks
    queries = list(range(0, 3 * ATTENTION_BLOCK, 2))  # 1.5 blocks of scattered positions
    blocks = runner_blocks(queries)
    assert [(s, e) for s, e, _ in blocks] == [
        (0, ATTENTION_BLOCK),
        (ATTENTION_BLOCK, len(queries)),
    ]
    assert [keys for *_, keys in blocks] == [queries[ATTENTION_BLOCK - 1] + 1, queries[-1] + 1]
    assert runner_blocks([]) == []


def test_rotate_is_the_models_own_rope(engine_for):
    engine = engine_for("llama3")
    runner = LayerRunner(engine.model)
    rope = __import__(type(runner.layers[0].self_attn).__module__, fromlist=["x"])
    cos, sin = runner.rope_tables(7)
    x = torch.randn(2, 7, runner.shape.head_dim)
    expected, _ = rope.apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    torch.testing.assert_close(runner.rotate(x, cos, sin), expected[0])
