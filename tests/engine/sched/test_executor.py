"""An engine step: the decode rows of a step that also prefills are fused into the prefills' forward
(one projection for both in the layers they share), a prefill in flight goes on in every step
however the decodes fill it, and what each sequence decodes is unchanged."""

from __future__ import annotations

import torch

from engine.blend.budget import MIN_PIECE_ROWS, StepBudget
from engine.blend.dense import advance_together, run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.sched.blocks import BlockManager
from engine.sched.scheduler import MIN_PREFILL_TOKENS
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


def serving_engine(path) -> Engine:
    return Engine.from_pretrained(
        path, check_layers=(1,), max_num_batched_tokens=2 * MIN_PREFILL_TOKENS
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


def test_the_decode_rows_of_a_step_that_prefills_are_fused_into_its_forward(
    checkpoint_dir, make_chunks, monkeypatch
):
    engine = serving_engine(checkpoint_dir("llama"))
    events: list = []  # (layer, rows) of each projection; a StepRecord ends each step

    def record() -> None:
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
    prefill = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.FULL_PREFILL)))
    engine.runner.write_prompt(table, prefill.output.keys, prefill.output.values)
    token, position = int(prefill.output.logits.argmax()), layout.num_tokens
    alone = engine.runner.decode([table], [position], [token])

    prefilling = request(make_chunks(3, seed=34), mode=Mode.FULL_PREFILL)
    steps = engine.prefiller.prefill(
        engine.layout(prefilling), PrefillAsk.of(prefilling), StepBudget(MIN_PIECE_ROWS)
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


def test_a_prefill_in_flight_computes_in_every_step_while_another_sequence_decodes(
    checkpoint_dir, make_chunks
):
    """Decodes in every step, the budget at its floor: the later prompt's prefill goes on in
    each step until it completes (its share spent each time), and both sequences get the
    tokens they get alone."""
    engine = serving_engine(checkpoint_dir("llama"))
    progress: list[list[float]] = []  # per step: the budget used by each prefill still in flight

    def listen(record: StepRecord) -> None:
        in_flight = engine.scheduler.prefilling
        progress.append([seq.budget.used for seq in in_flight if seq.budget is not None])

    try:
        serve_while_one_decodes(
            engine, make_chunks(5, words=40, seed=35), lambda: engine.add_step_listener(listen)
        )
    finally:
        engine.close()
    used = [p[0] for p in progress if p]
    assert len(used) >= 4  # the prompt went in pieces over several steps
    layers = engine.ops.shape.num_layers
    steps = [b - a for a, b in zip(used, used[1:], strict=False)]
    assert all(step >= MIN_PREFILL_TOKENS * layers for step in steps)  # never a step without
