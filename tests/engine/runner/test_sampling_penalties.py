"""Presence, frequency and repetition penalties: the formulas on small tensors, transformers'
repetition penalty, batched decode with mixed penalties, and exactness of the defaults."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.runner.penalties import PenaltyState
from engine.types import NO_PENALTIES, GenerateRequest, GenerationDefaults, Mode, Penalties

VOCAB = 7


def reference(
    logits: list[float], prompt: list[int], output: list[int], p: Penalties
) -> list[float]:
    """The vLLM/OpenAI definition written out token by token."""
    result = []
    for token, value in enumerate(logits):
        count = output.count(token)
        if token in prompt or count:
            value = value / p.repetition if value > 0 else value * p.repetition
        result.append(value - p.frequency * count - p.presence * (count > 0))
    return result


def state_with(histories: list[tuple[list[int], list[int]]]) -> PenaltyState:
    """A state whose lane i holds the (prompt, output) of histories[i], token by token."""
    state = PenaltyState(len(histories), VOCAB, torch.device("cpu"))
    for lane, (prompt, output) in enumerate(histories):
        state.start(lane, prompt)
        for token in output:
            state.add(lane, token)
    return state


def test_each_row_is_penalised_by_its_own_penalties_as_the_formula_says():
    histories = [([1, 2], [3, 3, 4, 1]), ([5], [0]), ([0, 6], [])]
    penalties = [
        Penalties(presence=0.5, frequency=0.25, repetition=1.3),
        Penalties(presence=-1.0, frequency=2.0, repetition=0.8),
        Penalties(repetition=2.0),
    ]
    logits = torch.tensor(
        [
            [1.0, -2.0, 3.0, 0.5, -0.5, 0.0, 2.0],
            [-1.0, 2.0, -3.0, 1.5, 0.25, 4.0, -2.0],
            [2.0, 1.0, 0.0, -1.0, 3.0, 0.5, -4.0],
        ]
    )
    got = state_with(histories).apply(logits, [0, 1, 2], penalties)
    expected = torch.tensor(
        [
            reference(row.tolist(), prompt, output, p)
            for row, (prompt, output), p in zip(logits, histories, penalties, strict=True)
        ]
    )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)


def test_rows_without_penalties_come_back_bit_for_bit_beside_penalised_ones():
    # Slot 1 holds a finished sequence's stale counts: a neutral row must not feel them.
    state = state_with([([1], [2]), ([3], [3, 4, 4])])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    got = state.apply(logits, [0, 1], [Penalties(repetition=1.5), NO_PENALTIES])
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_a_batch_without_penalties_is_returned_untouched():
    state = state_with([([1], [2])])
    logits = torch.randn(1, VOCAB)
    assert state.apply(logits, [0], [NO_PENALTIES]) is logits


def test_starting_a_lane_forgets_the_previous_sequence():
    state = state_with([([1, 2], [3, 3])])
    state.start(0, [5])
    logits = torch.ones(1, VOCAB)
    got = state.apply(logits, [0], [Penalties(presence=1.0, frequency=1.0, repetition=2.0)])
    assert got[0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("repetition_penalty", float("inf")),
    ],
)
def test_a_penalty_out_of_range_is_an_invalid_request_naming_it(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        GenerateRequest(question="q", **{field: value})


def request(chunks, **overrides) -> GenerateRequest:
    values = {"question": "which tas does kalo hold?", "chunks": chunks, "max_tokens": 12}
    return GenerateRequest(**{**values, **overrides})


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_repetition_penalty_decodes_what_transformers_generate_decodes(
    engine_for, make_chunks, family
):
    engine = engine_for(family)
    chunks = make_chunks(2, seed=31)
    penalised = engine.generate(request(chunks, mode=Mode.FULL_PREFILL, repetition_penalty=1.8))
    plain = engine.generate(request(chunks, mode=Mode.FULL_PREFILL))
    prompt = torch.tensor([engine.layout(request(chunks)).token_ids])
    with torch.inference_mode():
        reference_ids = engine.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=engine.tokenizer.pad_token_id,
        )[0, prompt.shape[1] :].tolist()
    eos = sorted(engine.eos_ids)
    cut = next((i for i, t in enumerate(reference_ids) if t in eos), len(reference_ids))
    assert penalised.token_ids == reference_ids[:cut]
    assert penalised.token_ids != plain.token_ids, "pick a prompt the penalty changes"


def test_requests_with_mixed_penalties_decode_together_what_they_decode_alone(
    engine_for, make_chunks
):
    engine = engine_for("mistral")
    chunks = make_chunks(3, seed=32)
    engine.precompute(chunks)
    requests = [
        request(chunks, recompute_ratio=0.5),
        request(chunks[:2], mode=Mode.FULL_PREFILL, repetition_penalty=1.6),
        request(chunks, mode=Mode.FULL_REUSE, frequency_penalty=1.5, presence_penalty=0.5),
        request(chunks[1:], recompute_ratio=1.0, presence_penalty=-1.0, max_tokens=5),
        request(chunks, repetition_penalty=0.7, frequency_penalty=-0.5),
    ]
    one_at_a_time = [engine.generate(r).token_ids for r in requests]

    async def together():
        async def run(req):
            *_, result = [event async for event in engine.start(req)]
            return result.token_ids

        return await asyncio.gather(*(run(r) for r in requests))

    assert asyncio.run(together()) == one_at_a_time
    # Each penalty changed its request's tokens, so the batch really mixed them.
    plain = [
        engine.generate(
            request(
                r.chunks, mode=r.mode, recompute_ratio=r.recompute_ratio, max_tokens=r.max_tokens
            )
        ).token_ids
        for r in requests[1:]
    ]
    assert all(p != t for p, t in zip(plain, one_at_a_time[1:], strict=True))


def test_the_engines_default_penalties_fill_what_a_request_leaves_unset(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(2, seed=33)
    plain = engine.generate(request(chunks, mode=Mode.FULL_PREFILL)).token_ids
    explicit = engine.generate(
        request(chunks, mode=Mode.FULL_PREFILL, repetition_penalty=1.8, frequency_penalty=0.5)
    ).token_ids
    before, engine.defaults = (
        engine.defaults,
        GenerationDefaults(frequency_penalty=0.5, repetition_penalty=1.8),
    )
    try:
        defaulted = engine.generate(request(chunks, mode=Mode.FULL_PREFILL)).token_ids
        overridden = engine.generate(
            request(chunks, mode=Mode.FULL_PREFILL, repetition_penalty=1.0, frequency_penalty=0.0)
        ).token_ids
    finally:
        engine.defaults = before
    assert defaulted == explicit != plain
    assert overridden == plain
