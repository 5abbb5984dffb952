"""Paged decode against the slot decode it replaces: the same logits and the same KV for a batch
of mixed lengths, blocks shuffled through the pool or in runs, by both attention paths."""

from __future__ import annotations

import random

import pytest
import torch

from demo.tiny import FAMILIES
from engine.runner import ModelRunner
from engine.types import GenerateRequest, Mode
from tests.engine.slot_reference import SlotPool

# float32 on the CPU; the paged rows attend over more (masked) keys than the slot rows, so the
# sums may round differently.
RTOL, ATOL = 1e-4, 1e-5
BLOCK_SIZE = 4  # small blocks: every prompt spans many, in shuffled order
STEPS = 5


def prompt_kv(engine, chunks) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A full prefill's KV [L, H_kv, n, D] of a prompt over `chunks`, and its first token."""
    req = GenerateRequest(question="which tas does kalo hold?", chunks=chunks, max_tokens=8)
    prefill = engine.prefiller.prefill(engine.layout(req), Mode.FULL_PREFILL)
    return prefill.output.keys, prefill.output.values, int(prefill.output.logits.argmax())


def block_tables(lengths: list[int], num_blocks: int, seed: int | None) -> list[list[int]]:
    """Disjoint block tables with room for each length plus STEPS: in random pool order, or
    (seed None) runs of consecutive ids, the first table's two halves swapped."""
    ids = list(range(num_blocks))
    if seed is not None:
        random.Random(seed).shuffle(ids)
    tables = []
    for n in lengths:
        need = -(-(n + STEPS) // BLOCK_SIZE)
        tables.append(ids[:need])
        ids = ids[need:]
    if seed is None:  # one row gathered beside rows read as views
        half = len(tables[0]) // 2
        tables[0] = tables[0][half:] + tables[0][:half]
    return tables


def paged_kv(runner: ModelRunner, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first n positions read back from its blocks as [L, H_kv, n, D]."""
    size = runner.block_size
    rows = torch.tensor(table)[torch.arange(n) // size] * size + torch.arange(n) % size
    keys = runner.keys.flatten(1, 2)[:, rows].transpose(1, 2)
    return keys, runner.values.flatten(1, 2)[:, rows].transpose(1, 2)


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "batched"])
@pytest.mark.parametrize("blocks", ["shuffled", "runs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_decode_matches_the_slot_decode(engine_for, make_chunks, family, blocks, per_row):
    engine = engine_for(family)
    prompts = [make_chunks(4, words=40, seed=31), make_chunks(1, seed=32), make_chunks(2, seed=33)]
    kvs = [prompt_kv(engine, chunks) for chunks in prompts]
    lengths = [k.shape[2] for k, _, _ in kvs]
    assert len(set(lengths)) == 3 and any(n % BLOCK_SIZE for n in lengths), "mixed, ragged"
    model_len = max(lengths) + STEPS + 1
    slots = SlotPool(engine.ops, len(kvs), model_len)
    num_blocks = 3 * len(kvs) * -(-model_len // BLOCK_SIZE)  # room to scatter
    paged = ModelRunner(engine.ops, num_blocks, BLOCK_SIZE, model_len, num_lanes=1)
    paged.per_row = per_row  # both attention paths, whatever the device picks
    seed = FAMILIES.index(family) if blocks == "shuffled" else None
    tables = block_tables(lengths, num_blocks, seed)
    runs = [t == list(range(t[0], t[0] + len(t))) for t in tables]
    assert not any(runs) if blocks == "shuffled" else all(runs[1:]) and not runs[0]
    for slot, ((keys, values, _), table) in enumerate(zip(kvs, tables, strict=True)):
        slots.write_prompt(slot, keys, values)
        paged.write_prompt(table, keys, values)

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
