"""Batched decode from the KV pool: every sequence of a batch decodes what it decodes alone,
with mixed prompt lengths and modes, sequences joining and leaving between steps, and prefills
paused by the step's token budget while others decode."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from demo.tiny import FAMILIES
from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.sched.blocks import BlockManager
from engine.sched.scheduler import MIN_PREFILL_TOKENS
from engine.types import GenerateRequest, Mode, StepRecord
from tests.engine.serving import while_first_decodes

# float32 on the CPU: a batched matmul may round differently from a batch of one.
ATOL = 1e-4


def request(chunks, **overrides) -> GenerateRequest:
    values = {"question": "which tas does kalo hold?", "chunks": chunks, "max_tokens": 8}
    return GenerateRequest(**{**values, **overrides})


def prefill_into_blocks(engine, table: list[int], req: GenerateRequest) -> tuple[int, int]:
    """Prefill `req` into the blocks of `table`; its first greedy token and the position it
    goes to."""
    layout = engine.layout(req)
    prefill = run_to_end(
        engine.prefiller.prefill(layout, PrefillAsk(req.mode, req.recompute_ratio))
    )
    engine.runner.write_prompt(table, prefill.output.keys, prefill.output.values)
    return int(prefill.output.logits.argmax()), layout.num_tokens


def decode_alone(
    engine, table: list[int], token: int, position: int, steps: int
) -> list[torch.Tensor]:
    logits = []
    for _ in range(steps):
        row = engine.runner.decode([table], [position], [token])[0]
        logits.append(row)
        token, position = int(row.argmax()), position + 1
    return logits


def assert_same_step(batched: torch.Tensor, alone: torch.Tensor) -> None:
    torch.testing.assert_close(batched, alone, rtol=0, atol=ATOL)
    top2 = alone.topk(2).values
    # The greedy token is only pinned where rounding cannot flip it.
    assert top2[0] - top2[1] > 2 * ATOL, "pick a prompt with a clear greedy margin"
    assert int(batched.argmax()) == int(alone.argmax())


def generate_in_one_step(engine: Engine, requests: list[GenerateRequest]) -> list:
    """Generate `requests` on threads, queued in this order while the worker is held by a
    background task, so that one step admits them all; their results."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(timeout=60)

    # Only an idle worker runs background work: once `hold` runs, nothing is left to step.
    engine.worker.submit(hold)
    assert held.wait(timeout=60)
    results: list = [None] * len(requests)

    def run(index: int) -> None:
        results[index] = engine.generate(requests[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    try:
        for queued, thread in enumerate(threads, start=1):
            thread.start()
            deadline = time.monotonic() + 60
            while engine.num_waiting < queued:  # one at a time: the step prefills in order
                assert time.monotonic() < deadline, "a request was not queued"
                time.sleep(0.001)
    finally:
        release.set()
    for thread in threads:
        thread.join(timeout=60)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_each_sequence_of_a_batch_decodes_what_it_decodes_alone(engine_for, make_chunks, family):
    engine = engine_for(family)
    long_chunks, short_chunks = make_chunks(5, words=40, seed=21), make_chunks(1, seed=22)
    engine.precompute(long_chunks + short_chunks)
    requests = [
        request(long_chunks, recompute_ratio=0.3),  # cacheblend, ~300 positions
        request(short_chunks, mode=Mode.FULL_PREFILL),
        request(long_chunks[:2], mode=Mode.FULL_REUSE),
        request(long_chunks[1:4], mode=Mode.PREFIX_CACHE),
    ]
    steps = 6
    # Blocks of the engine's own pool, which nothing else uses while this test runs: the
    # prefixes earlier requests left shared in it are given back first.
    engine.scheduler.prefixes.reclaim(engine.runner.num_blocks)
    pool = BlockManager(engine.runner.num_blocks, engine.runner.block_size)
    tables = [pool.allocate(i, engine.max_model_len) for i in range(len(requests))]
    # Alone: each request prefilled and decoded by itself, as a batch of one.
    alone = []
    for table, req in zip(tables, requests, strict=True):
        token, position = prefill_into_blocks(engine, table, req)
        alone.append(decode_alone(engine, table, token, position, steps))

    # Batched: 0 and 1 start, 2 joins after two steps, 3 after three, 1 leaves after four;
    # their blocks are refilled from scratch first.
    joins = {0: [0, 1], 2: [2], 3: [3]}
    leaves = {4: [1]}
    state: dict[int, tuple[int, int]] = {}
    done: dict[int, int] = {i: 0 for i in range(len(requests))}
    step = 0
    while any(done[i] < steps for i in state) or step in joins or not state:
        for i in joins.get(step, []):
            state[i] = prefill_into_blocks(engine, tables[i], requests[i])
        for i in leaves.get(step, []):
            state.pop(i)
        live = [i for i in state if done[i] < steps]
        if not live:
            break
        logits = engine.runner.decode(
            [tables[i] for i in live], [state[i][1] for i in live], [state[i][0] for i in live]
        )
        for i, row in zip(live, logits, strict=True):
            assert_same_step(row, alone[i][done[i]])
            state[i] = (int(row.argmax()), state[i][1] + 1)
            done[i] += 1
        step += 1
    assert done[0] == done[2] == done[3] == steps and done[1] == 4


def test_concurrent_requests_get_the_tokens_they_get_one_at_a_time(engine_for, make_chunks):
    engine = engine_for("qwen2")
    chunks = make_chunks(4, seed=23)
    engine.precompute(chunks)
    requests = [
        request(chunks, recompute_ratio=0.5, max_tokens=10),
        request(chunks[:2], mode=Mode.FULL_PREFILL, max_tokens=6),
        request(chunks[1:], mode=Mode.FULL_REUSE, max_tokens=12),
        request(chunks[2:], recompute_ratio=1.0, max_tokens=3),
    ]
    one_at_a_time = [engine.generate(r).token_ids for r in requests]

    async def together():
        async def run(req):
            *_, result = [event async for event in engine.start(req)]
            return result.token_ids

        return await asyncio.gather(*(run(r) for r in requests))

    assert asyncio.run(together()) == one_at_a_time


def test_a_prompt_longer_than_max_model_len_is_refused_before_queueing(engine_for):
    engine = engine_for("llama")
    too_long = request((), max_tokens=engine.max_model_len)
    with pytest.raises(ValueError, match="maximum of"):
        engine.generate(too_long)
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_the_streams_of_one_prefill_step_are_opened_together_so_the_next_is_prefetched(
    tiny_model, make_chunks
):
    engine = Engine.from_pretrained(tiny_model, check_layers=(1,))
    try:
        long_chunks, chunks = make_chunks(30, words=60, seed=23), make_chunks(2, seed=24)
        engine.precompute(chunks)
        # The first prompt reads no KV, so the loader is free for the second prompt's stream
        # while the first computes its ~3.4K positions (tens of milliseconds: longer than a
        # thread's wait for a core while another process keeps both busy).
        requests = [
            request(long_chunks, mode=Mode.FULL_PREFILL),
            request(chunks, recompute_ratio=0.5),
        ]
        alone = [engine.generate(r).token_ids for r in requests]
        engine.store.flush()  # no promotion of `alone`'s reads is left to delay a load
        results = generate_in_one_step(engine, requests)
        assert [r.token_ids for r in results] == alone
        # The second prompt's first layers were loaded before its own prefill began.
        second = [t.load_start_s for t in results[1].layers if t.load_start_s is not None]
        assert second and min(second) < 0
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefills_split_by_a_small_step_budget_decode_what_they_decode_alone(
    checkpoint_dir, make_chunks, family
):
    engine = Engine.from_pretrained(
        checkpoint_dir(family),
        check_layers=(1,),
        max_num_batched_tokens=MIN_PREFILL_TOKENS,
    )
    steps: list[StepRecord] = []
    engine.add_step_listener(steps.append)
    try:
        long_chunks = make_chunks(5, words=40, seed=25)
        engine.precompute(long_chunks)
        first = request(long_chunks[:1], mode=Mode.FULL_PREFILL, max_tokens=48, ignore_eos=True)
        later = [
            request(long_chunks, recompute_ratio=0.3),
            request(long_chunks[1:], mode=Mode.FULL_PREFILL),
            request(long_chunks[2:], mode=Mode.PREFIX_CACHE),
        ]
        alone = [engine.generate(r).token_ids for r in [first, *later]]
        engine.drain()  # the last step's listeners have run
        steps.clear()

        assert while_first_decodes(engine, first, later) == alone
    finally:
        engine.close()
    # Prefills paused beside decodes: steps that decoded and computed a piece of a prefill
    # that did not complete in them, none feeding more than the budget's decodes.
    paused = [s for s in steps if s.num_decodes and s.num_prefills and not s.prefill_tokens]
    assert len(paused) >= 3
    assert max(s.num_decodes for s in steps) <= MIN_PREFILL_TOKENS


def test_once_a_prefill_of_an_idle_step_completes_the_next_prefill_keeps_to_the_budget(
    checkpoint_dir, make_chunks
):
    # Prefills one after another (not side by side): the first one completes before the next.
    engine = Engine.from_pretrained(
        checkpoint_dir("llama"),
        check_layers=(1,),
        max_num_batched_tokens=MIN_PREFILL_TOKENS,
        prefill_batch_tokens=0,
    )
    steps: list[StepRecord] = []
    try:
        long_chunks = make_chunks(4, words=40, seed=26)
        requests = [
            request(long_chunks[:2], mode=Mode.FULL_PREFILL),
            request(long_chunks[2:], mode=Mode.FULL_PREFILL),
        ]
        alone = [engine.generate(r).token_ids for r in requests]
        engine.drain()  # the last step's listeners have run
        engine.add_step_listener(steps.append)
        results = generate_in_one_step(engine, requests)
    finally:
        engine.close()
    assert [r.token_ids for r in results] == alone
    # Nothing decoded in the first step, so the first prefill ran whole; then its sequence
    # waited for a token, and the second prefill paused at the budget instead of running whole.
    at = next(i for i, s in enumerate(steps) if s.num_prefills)
    first, after = steps[at], steps[at + 1]
    assert first.num_decodes == 0 and first.num_prefills == 2
    assert first.prefill_tokens == engine.layout(requests[0]).num_tokens
    assert after.num_decodes == 1 and after.num_prefills == 1
