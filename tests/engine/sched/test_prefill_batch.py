"""Prefills admitted together run side by side, their projections and MLPs of a layer batched
into one forward: each gets the KV and logits it gets alone, in every mode and on every family,
with or without a step budget, and an engine that batches decodes the tokens it decodes alone."""

from __future__ import annotations

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.budget import MIN_PIECE_ROWS, StepBudget
from engine.blend.dense import advance_together, side_by_side
from engine.blend.prefill import Prefill, PrefillAsk
from engine.engine import Engine
from engine.types import GenerateRequest, Mode, StepRecord
from tests.engine.blend.test_split_prefill import assert_same  # float32 rounding, as pieces
from tests.engine.sched.test_batching import generate_in_one_step

MODES = [
    {"mode": Mode.FULL_PREFILL},
    {"mode": Mode.CACHEBLEND, "recompute_ratio": 0.3},
    {"mode": Mode.PREFIX_CACHE},
]


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, max_tokens=4, **overrides)


def together(engine, requests: list[GenerateRequest], per_step: float) -> tuple[list, int]:
    """The prefills of `requests` advanced side by side, `per_step` token-layers a step (inf:
    one unbounded step); their results and the steps taken."""
    budget = StepBudget()
    pausables = [
        engine.prefiller.prefill(engine.layout(r), PrefillAsk.of(r), budget, opened=None)
        for r in requests
    ]
    results: list[Prefill | None] = [None] * len(requests)

    def done(index: int, prefill: Prefill) -> None:
        results[index] = prefill

    def failed(index: int, exc: Exception) -> None:
        raise exc

    steps = 0
    while any(r is None for r in results):
        steps += 1
        budget.refill(per_step)
        live = [i for i, r in enumerate(results) if r is None]
        with torch.inference_mode():
            advance_together(
                [pausables[i] for i in live],
                lambda k, prefill, live=live: done(live[k], prefill),
                lambda k, exc, live=live: failed(live[k], exc),
            )
    return results, steps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("per_step", [float("inf"), 3 * MIN_PIECE_ROWS], ids=["whole", "pieces"])
def test_prefills_side_by_side_equal_each_alone(engine_for, make_chunks, family, per_step):
    engine = engine_for(family, (1, 2))
    chunks = make_chunks(6, seed=31)
    engine.precompute(chunks)
    # Different lengths and modes: the batches hold rows of each, split back by their counts.
    requests = [request(chunks[: 2 + k], **mode) for k, mode in enumerate(MODES)]
    alone = [engine.prefill(r) for r in requests]
    batched, _ = together(engine, requests, per_step)
    for a, b in zip(batched, alone, strict=True):
        assert_same(a, b)


def test_side_by_side_prefills_share_each_layers_projections(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(4, seed=32)
    requests = [request(chunks[k : k + 2], mode=Mode.FULL_PREFILL) for k in range(3)]
    ops, calls = engine.ops, []
    project = ops.project_qkv

    def counted(index, h):
        calls.append(h.shape[0])
        return project(index, h)

    ops.project_qkv = counted
    try:
        together(engine, requests, float("inf"))
    finally:
        del ops.project_qkv
    # One projection per layer for all three prompts, each call over all their rows.
    assert len(calls) == ops.shape.num_layers
    assert calls[0] == sum(engine.layout(r).num_tokens for r in requests)


def test_prefills_are_grouped_in_order_while_their_prompts_fit_the_limit():
    assert side_by_side([100, 200, 300, 50, 900, 10], 600) == [[0, 1, 2], [3], [4], [5]]
    assert side_by_side([700, 10, 10], 600) == [[0], [1, 2]]  # one over the limit runs alone
    assert side_by_side([10, 10], 0) == [[0], [1]]


def test_an_engine_that_batches_prefills_decodes_what_each_decodes_alone(
    checkpoint_dir, make_chunks
):
    engine = Engine.from_pretrained(
        checkpoint_dir("llama"), check_layers=(1,), prefill_batch_tokens=10_000
    )
    steps: list[StepRecord] = []
    try:
        chunks = make_chunks(4, words=30, seed=33)
        engine.precompute(chunks)
        requests = [
            request(chunks[:2], mode=Mode.CACHEBLEND, recompute_ratio=0.3),
            request(chunks[1:], mode=Mode.FULL_PREFILL),
            request(chunks[2:], mode=Mode.CACHEBLEND, recompute_ratio=0.3),
        ]
        alone = [engine.generate(r).token_ids for r in requests]
        engine.drain()  # the last step's listeners have run
        engine.add_step_listener(steps.append)
        results = generate_in_one_step(engine, requests)
    finally:
        engine.close()
    assert [r.token_ids for r in results] == alone
    first = next(s for s in steps if s.num_prefills)
    # Nothing decoded: the three prefills ran whole, side by side, and all completed.
    assert first.num_prefills == 3
    assert first.prefill_tokens == sum(engine.layout(r).num_tokens for r in requests)
