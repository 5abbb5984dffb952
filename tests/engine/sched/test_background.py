"""Background work: a bounded queue that refuses a precompute whole and drops a write-back when
full, and a chunk's KV computed in pieces, one after each engine step, as computed whole."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from engine.engine import Engine
from engine.errors import BackgroundQueueFullError
from engine.sched.background import BackgroundQueue, once
from engine.types import Chunk, GenerateRequest, StepRecord


def test_a_full_queue_refuses_a_batch_whole_and_names_its_bound():
    queue = BackgroundQueue(3)
    queue.submit_all([once(lambda: 1), once(lambda: 2)])
    with pytest.raises(BackgroundQueueFullError, match="background queue is full: 2 of 3"):
        queue.submit_all([once(lambda: 3), once(lambda: 4)])
    assert len(queue) == 2  # nothing of the refused batch was queued
    queue.submit_unbounded(once(lambda: 5))  # the engine's own markers are outside the bound
    assert len(queue) == 3


def test_an_offer_to_a_full_queue_is_dropped_and_counted():
    queue = BackgroundQueue(1)
    assert queue.offer(once(lambda: 1)) is not None
    assert queue.offer(once(lambda: 2)) is None
    assert queue.dropped == 1
    assert queue.run_piece() and not queue.run_piece()
    assert queue.offer(once(lambda: 3)) is not None  # room again once the head ran


def test_a_failing_task_fails_its_future_alone():
    queue = BackgroundQueue(4)

    def fail():
        raise RuntimeError("boom")

    failed, ok = queue.submit_all([once(fail), once(lambda: 7)])
    while queue.run_piece():
        pass
    with pytest.raises(RuntimeError, match="boom"):
        failed.result(timeout=0)
    assert ok.result(timeout=0) == 7


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_chunk_computed_in_pieces_matches_it_computed_whole(engine_for, make_chunks, family):
    engine = engine_for(family)
    prefiller, num_layers = engine.prefiller, engine.ops.shape.num_layers
    tokens = engine.prompts.chunk_tokens(make_chunks(1, words=60, seed=3)[0].text)
    queue = BackgroundQueue(1, num_layers)
    (future,) = queue.submit_all([lambda budget: prefiller.chunk_kv_steps(tokens, budget)])
    piece_tokens = 16
    while queue.run_piece(piece_tokens):
        pass
    # Every piece but the last spends its token-layers, and overshoots by less than a piece's
    # floor of rows (engine/budget.py): the count lies between what either would take.
    rows = (len(prefiller.chunk_prefix) + len(tokens)) * num_layers
    assert math.ceil(rows / (piece_tokens * num_layers + 16)) <= queue.pieces
    assert queue.pieces <= math.ceil(rows / (piece_tokens * num_layers))
    assert queue.pieces > 1
    whole = prefiller.compute_chunk_kv(tokens)
    torch.testing.assert_close(future.result(timeout=0).keys, whole.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(future.result(timeout=0).values, whole.values, rtol=1e-5, atol=1e-5)


def test_under_load_a_precompute_runs_one_piece_after_each_step(checkpoint_dir, make_chunks):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), max_num_batched_tokens=24)
    queue = engine.worker.background
    steps: list[tuple[int, int]] = []  # (pieces run, tasks waiting) as each step ends

    def listener(record: StepRecord) -> None:  # on the worker thread, before the step's piece
        steps.append((queue.pieces, len(queue)))

    engine.add_step_listener(listener)
    try:
        decoding = threading.Event()
        engine.add_step_listener(lambda record: record.num_decodes and decoding.set())
        request = GenerateRequest(question="which vo is zuka?", max_tokens=400, ignore_eos=True)
        generation = threading.Thread(target=engine.generate, args=(request,))
        generation.start()
        assert decoding.wait(60)
        chunk = Chunk("long", make_chunks(1, words=150, seed=5)[0].text)
        result = engine.precompute([chunk])
        assert generation.is_alive(), "the generation ended first: make it longer"
        generation.join(120)
    finally:
        engine.close()
    assert result.stored == 1
    # A step that ended with the chunk's task waiting was followed by exactly one piece, and
    # the chunk took several: its whole compute never ran between two steps.
    waited = [(a, b) for (a, waiting), (b, _) in zip(steps, steps[1:], strict=False) if waiting]
    assert len(waited) > 2
    assert all(b - a == 1 for a, b in waited)


def test_a_precompute_after_close_is_refused_not_left_waiting(checkpoint_dir, make_chunks):
    engine = Engine.from_pretrained(checkpoint_dir("llama"))
    engine.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.precompute(make_chunks(1, seed=9))
