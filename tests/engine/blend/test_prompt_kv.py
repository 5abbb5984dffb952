"""A prefill written into a sequence's blocks of the KV pool as its layer loop goes (PagedKV)
holds what the same prefill writes into a buffer of its own, on every family and mode, and
leaves the blocks of a shared prefix untouched."""

from __future__ import annotations

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.blend.prompt_kv import PagedKV
from engine.types import GenerateRequest, Mode

BLOCK = 4
SENTINEL = 7.0
RTOL, ATOL = 1e-5, 1e-6  # the same kernels over another memory layout of the same values


def _pool(engine, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = engine.ops.shape
    size = (shape.num_layers, num_blocks, BLOCK, shape.num_kv_heads, shape.head_dim)
    return torch.full(size, SENTINEL), torch.full(size, SENTINEL)


def _rows(pool: torch.Tensor, table: list[int], start: int, end: int) -> torch.Tensor:
    """[L, H_kv, n, D] of positions start..end-1 read straight from the pool's blocks."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(table)[positions // BLOCK]
    return pool[:, blocks, positions % BLOCK].transpose(1, 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [Mode.FULL_PREFILL, Mode.CACHEBLEND, Mode.FULL_REUSE])
def test_a_prefill_into_scattered_blocks_equals_one_into_its_own_buffer(
    engine_for, make_chunks, family, mode
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=11)
    engine.precompute(chunks)
    layout = engine.layout(GenerateRequest(question="who is zuka?", chunks=chunks, mode=mode))
    run_to_end(
        engine.prefiller.prefill(layout, PrefillAsk(mode, 0.3))
    )  # the prompt prefix cached for both runs below
    dense = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode, 0.3))).output
    num_tokens = layout.num_tokens
    count = -(-num_tokens // BLOCK)
    # Blocks out of order and apart: no view of the pool could stand for them.
    table = [3 * count - 1 - 3 * j for j in range(count)]
    pool = _pool(engine, 3 * count)
    paged = run_to_end(
        engine.prefiller.prefill(
            layout, PrefillAsk(mode, 0.3), out=PagedKV(pool, table, num_tokens)
        )
    )
    torch.testing.assert_close(paged.output.logits, dense.logits, rtol=RTOL, atol=ATOL)
    keys, values = paged.output.kv.read(0, num_tokens)
    torch.testing.assert_close(keys, dense.keys, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(values, dense.values, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_rows(pool[0], table, 0, num_tokens), dense.keys)
    written = torch.zeros(3 * count * BLOCK, dtype=torch.bool)
    positions = torch.arange(num_tokens)
    written[torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK] = True
    assert (pool[0].flatten(1, 2)[:, ~written] == SENTINEL).all()  # no other row touched


def test_the_blocks_of_a_shared_prefix_are_never_written(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(2, seed=12)
    engine.precompute(chunks)
    layout = engine.layout(GenerateRequest(question="who is zuka?", chunks=chunks))
    dense = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.CACHEBLEND, 0.3))).output
    num_tokens, shared = layout.num_tokens, 2 * BLOCK
    table = list(range(-(-num_tokens // BLOCK)))
    pool = _pool(engine, len(table))
    run_to_end(
        engine.prefiller.prefill(
            layout,
            PrefillAsk(Mode.CACHEBLEND, 0.3),
            out=PagedKV(pool, table, num_tokens, shared=shared),
        )
    )
    keys, values = pool
    assert (_rows(keys, table, 0, shared) == SENTINEL).all()
    assert (_rows(values, table, 0, shared) == SENTINEL).all()
    torch.testing.assert_close(_rows(keys, table, shared, num_tokens), dense.keys[:, :, shared:])
    torch.testing.assert_close(
        _rows(values, table, shared, num_tokens), dense.values[:, :, shared:]
    )
