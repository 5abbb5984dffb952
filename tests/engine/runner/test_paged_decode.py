"""Paged decode against the slot decode it replaces: the same logits and the same KV for a batch
of mixed lengths, blocks shuffled through the pool, in runs, or behind a shared prompt prefix,
by every attention path (per row, batched, batched and padded to a CUDA graph's bucket, flex
attention over the blocks in place, eagerly)."""

from __future__ import annotations

import random

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.runner.model_runner import ModelRunner
from engine.types import GenerateRequest, Mode
from tests.engine.slot_reference import SlotPool

# flex's eager reference on the CPU is the point here (exact, not fast); torch warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# float32 on the CPU; the paged rows attend over more (masked) keys than the slot rows, so the
# sums may round differently.
RTOL, ATOL = 1e-4, 1e-5
BLOCK_SIZE = 4  # small blocks: every prompt spans many, in shuffled order
STEPS = 5


def prompt_kv(engine, chunks) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A full prefill's KV [L, H_kv, n, D] of a prompt over `chunks`, and its first token."""
    req = GenerateRequest(question="which tas does kalo hold?", chunks=chunks, max_tokens=8)
    prefill = run_to_end(
        engine.prefiller.prefill(engine.layout(req), PrefillAsk(Mode.FULL_PREFILL))
    )
    return prefill.output.keys, prefill.output.values, int(prefill.output.logits.argmax())


def block_tables(
    lengths: list[int], num_blocks: int, seed: int | None, shared: int = 0
) -> list[list[int]]:
    """Block tables with room for each length plus STEPS, disjoint but for their first `shared`
    blocks (one prefix, held once): in random pool order, or (seed None) runs of consecutive
    ids, the first table's own blocks in two runs, swapped."""
    ids = list(range(num_blocks))
    if seed is not None:
        random.Random(seed).shuffle(ids)
    prefix, ids = ids[:shared], ids[shared:]
    tables = []
    for n in lengths:
        need = -(-(n + STEPS) // BLOCK_SIZE) - shared
        tables.append(prefix + ids[:need])
        ids = ids[need:]
    if seed is None:  # one row in more runs than the others
        own = tables[0][shared:]
        tables[0] = prefix + own[len(own) // 2 :] + own[: len(own) // 2]
    return tables


def num_runs(table: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))


def paged_kv(runner: ModelRunner, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first n positions read back from its blocks as [L, H_kv, n, D]."""
    size = runner.block_size
    rows = torch.tensor(table)[torch.arange(n) // size] * size + torch.arange(n) % size
    keys = runner.keys.flatten(1, 2)[:, rows].transpose(1, 2)
    return keys, runner.values.flatten(1, 2)[:, rows].transpose(1, 2)


@pytest.mark.parametrize("path", ["per-row", "batched", "bucketed", "flex"])
@pytest.mark.parametrize("blocks", ["shuffled", "runs", "shared-prefix"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_decode_matches_the_slot_decode(engine_for, make_chunks, family, blocks, path):
    engine = engine_for(family)
    prompts = [make_chunks(4, words=40, seed=31), make_chunks(1, seed=32), make_chunks(2, seed=33)]
    kvs = [prompt_kv(engine, chunks) for chunks in prompts]
    lengths = [k.shape[2] for k, _, _ in kvs]
    assert len(set(lengths)) == 3 and any(n % BLOCK_SIZE for n in lengths), "mixed, ragged"
    model_len = max(lengths) + STEPS + 1
    slots = SlotPool(engine.ops, len(kvs), model_len)
    num_blocks = 3 * len(kvs) * -(-model_len // BLOCK_SIZE)  # room to scatter
    paged = ModelRunner(engine.ops, num_blocks, BLOCK_SIZE, model_len, num_lanes=1)
    # Every attention path, whatever the device picks; bucketed: the batched one with its
    # rows and blocks padded to a bucket, as a CUDA graph replays it.
    paged.use_attention({"per-row": "per_row", "flex": "flex"}.get(path, "batched"))
    paged.bucketed = path == "bucketed"
    seed = FAMILIES.index(family) if blocks == "shuffled" else None
    # Every prompt starts with the same template and system prompt: its full blocks, held once.
    prefix = len(engine.layout(GenerateRequest(question="q", chunks=prompts[0])).prefix)
    shared = prefix // BLOCK_SIZE if blocks == "shared-prefix" else 0
    tables = block_tables(lengths, num_blocks, seed, shared)
    runs = [num_runs(t) for t in tables]
    if blocks == "shuffled":
        assert min(runs) > paged.max_view_runs, "gathered"
    else:
        # Behind the prefix, the first row in three runs (gathered), the others in two.
        assert runs == ([3, 2, 2] if shared else [2, 1, 1]), runs
    for slot, ((keys, values, _), table) in enumerate(zip(kvs, tables, strict=True)):
        slots.write_prompt(slot, keys, values)
        # A shared block is written by its first sequence only, as the engine does.
        paged.write_prompt(table, keys, values, start=shared * BLOCK_SIZE if slot else 0)

    tokens, positions = [t for _, _, t in kvs], list(lengths)
    for _ in range(STEPS):
        expected = slots.decode([0, 1, 2], positions, tokens)
        got = paged.decode(tables, positions, tokens)
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        tokens = expected.argmax(-1).tolist()
        positions = [p + 1 for p in positions]

    for slot, (table, n) in enumerate(zip(tables, positions, strict=True)):
        for got_kv, want_kv in zip(paged_kv(paged, table, n), slots.kv(slot, n), strict=True):
            torch.testing.assert_close(got_kv, want_kv, rtol=RTOL, atol=ATOL)
    # No block outside the tables was written: padding rows write the scratch block only.
    untouched = sorted(set(range(num_blocks)) - {b for t in tables for b in t})
    assert not paged.keys[:, untouched].any() and not paged.values[:, untouched].any()
