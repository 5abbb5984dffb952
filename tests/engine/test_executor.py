"""An engine step: the decode rows of a step that also prefills ride in the prefills' forward
(one projection for both in the layers they share), decoding sequences with slack lend a
prefill time past the budget and bank slack too short to be worth lending, and what each
sequence decodes is unchanged."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

import engine.executor
from engine.blocks import BlockManager
from engine.budget import MIN_PIECE_ROWS, StepBudget, decode_slack_s
from engine.dense import advance_together
from engine.engine import Engine
from engine.scheduler import MIN_PREFILL_TOKENS
from engine.types import GenerateRequest, Mode, StepRecord
from tests.engine.serving import while_first_decodes


def request(chunks, **overrides) -> GenerateRequest:
    values = {"question": "which tas does kalo hold?", "chunks": chunks, "max_tokens": 8}
    return GenerateRequest(**{**values, **overrides})


def record_projections(engine: Engine, calls: list, monkeypatch) -> None:
    """Append (layer, rows) for every projection the engine's model runs, and ("decode", rows)
    for every decode run on its own."""
    project = engine.ops.project_qkv

    def counted(index, h):
        calls.append((index, h.shape[0]))
        return project(index, h)

    monkeypatch.setattr(engine.ops, "project_qkv", counted)
    decode = engine.runner.decode

    def decode_alone(tables, positions, token_ids):
        calls.append(("decode", len(tables)))
        return decode(tables, positions, token_ids)

    monkeypatch.setattr(engine.runner, "decode", decode_alone)


def serving_engine(path, decode_slack: float) -> Engine:
    return Engine.from_pretrained(
        path,
        check_layers=(1,),
        max_num_batched_tokens=2 * MIN_PREFILL_TOKENS,
        decode_slack=decode_slack,
    )


def serve_while_one_decodes(engine: Engine, chunks, record) -> None:
    """A long full prefill decoding while a second one arrives, each served alone first;
    `record()` is called between (listeners added there see only the served pair). Both get
    the tokens they get alone."""
    engine.precompute(chunks)
    first = request(chunks[:1], mode=Mode.FULL_PREFILL, max_tokens=40, ignore_eos=True)
    later = [request(chunks[1:], mode=Mode.FULL_PREFILL)]
    alone = [engine.generate(r).token_ids for r in [first, *later]]
    engine.drain()  # a result comes before its step's listeners run: let them run first
    record()
    assert while_first_decodes(engine, first, later) == alone


def test_the_decode_rows_of_a_step_that_prefills_ride_in_its_forward(
    checkpoint_dir, make_chunks, monkeypatch
):
    engine = serving_engine(checkpoint_dir("llama"), decode_slack=0.0)
    events: list = []  # (layer, rows) of each projection; a StepRecord ends each step

    def record() -> None:
        # The token count alone sizes the pieces (a learnt time allowance may end a piece
        # before the decode reaches its layer).
        engine.executor.budget.seconds_per_token = 0.0
        monkeypatch.setattr(engine.executor.budget, "observe", lambda *_, **__: None)
        record_projections(engine, events, monkeypatch)
        engine.add_step_listener(events.append)

    try:
        serve_while_one_decodes(engine, make_chunks(5, words=40, seed=31), record)
    finally:
        engine.close()
    layers = engine.ops.shape.num_layers
    steps, calls = [], []
    for event in events:
        if isinstance(event, StepRecord):
            steps.append((event, calls))
            calls = []
        else:
            calls.append(event)
    mixed = [(s, c) for s, c in steps if s.num_decodes and s.num_prefills]
    decode_only = [(s, c) for s, c in steps if s.num_decodes and not s.num_prefills]
    assert len(mixed) >= 3 and decode_only
    for step, calls in mixed:
        # No decode of its own: its rows join a prefill piece's projection in a layer they
        # share (the piece's rows and the decode's in one call), running alone in the others.
        assert ("decode", step.num_decodes) not in calls
        assert sorted(i for i, rows in calls if rows == step.num_decodes) != list(range(layers))
        assert step.decode_s == 0.0 and step.prefill_s > 0.0
    for step, calls in decode_only:
        assert calls[0] == ("decode", step.num_decodes)
        assert [rows for _, rows in calls[1:]] == [step.num_decodes] * layers


def test_a_decode_joins_the_projection_of_a_prefill_piece_in_the_layer_they_share(
    engine_for, make_chunks, monkeypatch
):
    engine = engine_for("llama")
    layers = engine.ops.shape.num_layers
    decoding = request(make_chunks(2, seed=33), mode=Mode.FULL_PREFILL)
    layout = engine.layout(decoding)
    engine.scheduler.prefixes.reclaim(engine.runner.num_blocks)
    table = BlockManager(engine.runner.num_blocks, engine.runner.block_size).allocate(
        0, engine.max_model_len
    )
    prefill = engine.prefiller.prefill(layout, Mode.FULL_PREFILL)
    engine.runner.write_prompt(table, prefill.output.keys, prefill.output.values)
    token, position = int(prefill.output.logits.argmax()), layout.num_tokens
    alone = engine.runner.decode([table], [position], [token])

    prefilling = request(make_chunks(3, seed=34), mode=Mode.FULL_PREFILL)
    steps = engine.prefiller.request_steps(
        engine.layout(prefilling), prefilling, StepBudget(MIN_PIECE_ROWS)
    )
    calls: list = []
    record_projections(engine, calls, monkeypatch)
    results: dict = {}

    def failed(index: int, exc: Exception) -> None:
        raise exc

    with torch.inference_mode():
        decode = engine.runner.decode_steps([table], [position], [token])
        advance_together([steps, decode], results.__setitem__, failed)
    steps.close()
    # The piece of layer 0 and the decode row in one projection; the prefill then paused and
    # the decode went on alone. Its logits are those of the decode alone.
    assert calls == [(0, MIN_PIECE_ROWS + 1)] + [(i, 1) for i in range(1, layers)]
    assert list(results) == [1]
    torch.testing.assert_close(results[1], alone, rtol=0, atol=1e-4)


def test_decoding_sequences_with_slack_lend_a_prefill_the_step_past_its_budget(
    checkpoint_dir, make_chunks
):
    mixed_steps = {}
    for slack in (0.0, 1e6):
        engine = serving_engine(checkpoint_dir("llama"), decode_slack=slack)
        records: list[StepRecord] = []
        try:
            chunks = make_chunks(5, words=40, seed=35)
            serve_while_one_decodes(
                engine, chunks, partial(engine.add_step_listener, records.append)
            )
        finally:
            engine.close()
        mixed_steps[slack] = sum(1 for r in records if r.num_decodes and r.num_prefills)
    # With slack the first step keeps to the budget (it learns the pace the time is read in),
    # the next runs the rest; without it, the prompt goes in budget-sized pieces.
    assert mixed_steps[1e6] <= 2 < 4 <= mixed_steps[0.0]


def test_decoding_sequences_without_slack_bank_it_and_a_long_prefill_waits_for_them(
    checkpoint_dir, make_chunks, monkeypatch
):
    # No decoding sequence ever has slack: once the budget has learnt its pace (the first
    # bounded piece), a step with decodes computes no prefill: its sequences bank what the
    # step leaves them. The later prompt waits until the first sequence ends, then runs whole.
    monkeypatch.setattr(engine.executor, "decode_slack_s", lambda *_: 0.0)
    served = serving_engine(checkpoint_dir("llama"), decode_slack=1e6)
    steps: list[tuple[StepRecord, bool]] = []  # each step, and whether a prefill was in flight

    def record() -> None:
        listen = lambda r: steps.append((r, bool(served.scheduler.prefilling)))  # noqa: E731
        served.add_step_listener(listen)

    try:
        serve_while_one_decodes(served, make_chunks(5, words=40, seed=36), record)
    finally:
        served.close()
    mixed = [r for r, _ in steps if r.num_decodes and r.num_prefills]
    banked = [r for r, waits in steps if r.num_decodes and not r.num_prefills and waits]
    assert len(mixed) <= 2 and len(banked) >= 30
    # Each decodes on its own (the decode step's time is learnt from it), but not alone in the
    # engine: the waiting prefill is counted, so the unloaded decode time is not learnt from it.
    assert all(r.decode_s > 0.0 and r.others == 1 and not r.alone for r in banked)


def test_a_prompt_that_fits_the_token_count_whole_does_not_wait_for_slack(
    checkpoint_dir, make_chunks, monkeypatch
):
    monkeypatch.setattr(engine.executor, "decode_slack_s", lambda *_: 0.0)
    served = Engine.from_pretrained(
        checkpoint_dir("llama"), check_layers=(1,), max_num_batched_tokens=4096, decode_slack=1e6
    )
    steps: list[tuple[StepRecord, bool]] = []  # each step, and whether a prefill was in flight

    def record() -> None:
        served.executor.budget.seconds_per_token = 1e-4  # a pace learnt: slack counts
        listen = lambda r: steps.append((r, bool(served.scheduler.prefilling)))  # noqa: E731
        served.add_step_listener(listen)

    try:
        serve_while_one_decodes(served, make_chunks(5, words=40, seed=37), record)
    finally:
        served.close()
    # The later prompt prefills whole beside the other's decode: no step banks for it.
    mixed = [r for r, _ in steps if r.num_decodes and r.num_prefills]
    banked = [r for r, waits in steps if r.num_decodes and not r.num_prefills and waits]
    assert len(mixed) == 1 and mixed[0].prefill_tokens > 0 and not banked


def test_the_slack_is_the_least_time_a_decoding_sequence_can_wait():
    now = 100.0
    # 10 tokens since 99.0 at a 0.2 s target: may reach 101.0; 2 tokens since 99.9: 100.3.
    assert decode_slack_s([(99.0, 10), (99.9, 2)], 0.2, now) == pytest.approx(0.3)
    assert decode_slack_s([(99.0, 2)], 0.2, now) < 0  # behind its target: nothing to lend
    assert decode_slack_s([], 0.2, now) == math.inf
