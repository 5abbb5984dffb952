"""Decoding from the blended cache: greedy equality with transformers, sampling, stops, streams."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from demo.tiny import FAMILIES
from engine.sched.detokenize import IncrementalText
from engine.sched.sampling import Sampler, generator_seed
from engine.types import GenerateRequest, GenerateResult, Mode, TokenDelta


def request(chunks, **overrides) -> GenerateRequest:
    values = {"question": "where is the sol of kalo?", "chunks": chunks, "max_tokens": 12}
    return GenerateRequest(**{**values, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "options", [{"mode": Mode.FULL_PREFILL}, {"recompute_ratio": 1.0}], ids=["full", "ratio1"]
)
def test_greedy_decoding_from_the_pool_matches_model_generate(
    engine_for, make_chunks, family, options
):
    engine = engine_for(family)
    chunks = make_chunks(3, seed=3)
    engine.precompute(chunks)
    result = engine.generate(request(chunks, **options))
    prompt = torch.tensor([engine.layout(request(chunks)).token_ids])
    with torch.inference_mode():
        reference = engine.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=engine.tokenizer.pad_token_id,
        )
    expected = reference[0, prompt.shape[1] :].tolist()
    # Our decoder stops at EOS; transformers was told not to, so compare up to it.
    eos = sorted(engine.eos_ids)
    cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    assert result.token_ids == expected[:cut]
    assert result.finish_reason == ("stop" if cut < len(expected) else "length")


def test_seeded_sampling_repeats_and_different_seeds_differ(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(2, seed=5)
    sampled = [
        engine.generate(
            request(
                chunks,
                mode=Mode.FULL_PREFILL,
                temperature=1.5,
                top_p=0.95,
                seed=seed,
                max_tokens=16,
            )
        )
        for seed in (1, 1, 2)
    ]
    assert sampled[0].token_ids == sampled[1].token_ids
    assert sampled[0].token_ids != sampled[2].token_ids


def test_tiny_top_p_samples_the_greedy_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    sampler = Sampler(temperature=1.0, top_p=1e-6, seed=0)
    assert {sampler(logits) for _ in range(20)} == {1}


def test_max_tokens_bounds_the_completion(engine_for, make_chunks):
    engine = engine_for("mistral")
    result = engine.generate(request(make_chunks(2, seed=6), max_tokens=3))
    assert result.usage.completion_tokens <= 3
    assert result.finish_reason in {"length", "stop"}


class _CharTokenizer:
    """Decodes ids as characters: enough to pin the text logic without a model."""

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


def test_stop_string_cuts_the_text_and_is_never_emitted():
    text = IncrementalText(_CharTokenizer(), stop=("END",))
    emitted = "".join(text.add(ord(c)) for c in "hello EN")
    assert emitted == "hello "  # "EN" held back: it may become the stop string
    emitted += text.add(ord("D"))
    assert text.stopped and text.text == "hello " and emitted == "hello "


def test_held_back_text_is_released_when_it_cannot_be_a_stop_string():
    text = IncrementalText(_CharTokenizer(), stop=("END",))
    emitted = "".join(text.add(ord(c)) for c in "ENX")
    assert emitted == "ENX" and not text.stopped


def test_stop_strings_end_generation_with_reason_stop(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(2, seed=8)
    free = engine.generate(request(chunks, mode=Mode.FULL_PREFILL, max_tokens=16))
    assert len(free.text) > 4
    stop = free.text[2:4]
    stopped = engine.generate(request(chunks, mode=Mode.FULL_PREFILL, max_tokens=16, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]


def test_async_stream_yields_deltas_that_add_up_to_the_result(engine_for, make_chunks):
    engine = engine_for("qwen3")
    chunks = make_chunks(3, seed=9)
    engine.precompute(chunks)
    fixed = request(chunks, recompute_ratio=0.15)  # the controller's choice may move
    engine.generate(fixed)  # fills the prefix cache, so both runs below take one path
    expected = engine.generate(fixed)

    async def collect():
        return [event async for event in engine.start(fixed)]

    events = asyncio.run(collect())
    *deltas, result = events
    assert all(isinstance(d, TokenDelta) for d in deltas) and isinstance(result, GenerateResult)
    assert "".join(d.text for d in deltas) == result.text
    assert result.timings.ttft_s > 0 and result.timings.ttft_s <= result.timings.total_s
    assert result.text == expected.text


def test_cancelling_a_generation_stops_it_and_frees_its_kv_blocks(engine_for, make_chunks):
    engine = engine_for("llama")
    long = request(make_chunks(1, seed=10), max_tokens=50, ignore_eos=True)

    async def two_deltas_then_cancel():
        generation = engine.start(long)
        produced = []
        async for event in generation:
            produced.append(event)
            if len(produced) == 2:
                generation.cancel()
                break
        return produced

    produced = asyncio.run(two_deltas_then_cancel())
    assert len(produced) == 2 and all(isinstance(e, TokenDelta) for e in produced)
    deadline = time.monotonic() + 10
    blocks, prefixes = engine.scheduler.blocks, engine.scheduler.prefixes
    # Every block is free but those of the prompt prefixes the pool keeps shared, which no
    # sequence holds any more: admission may give them back.
    while (
        blocks.num_free_blocks < blocks.num_blocks - prefixes.num_blocks
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert blocks.num_free_blocks == blocks.num_blocks - prefixes.num_blocks
    assert not engine.scheduler.running and sum(prefixes.idle().values()) == prefixes.num_blocks


@pytest.mark.parametrize("temperature", [1.79e-246, 5e-324, 1e-30])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    sampler = Sampler(temperature=temperature, top_p=1.0, seed=0)
    assert {sampler(logits) for _ in range(20)} == {1}


def test_a_top_p_below_every_float32_keeps_the_top_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    sampler = Sampler(temperature=0.5, top_p=1e-300, seed=0)
    assert {sampler(logits) for _ in range(20)} == {1}


def test_logits_that_are_not_finite_fall_back_to_greedy():
    logits = torch.tensor([0.1, float("nan"), 2.9, -1.0])
    assert Sampler(temperature=1.0, top_p=0.9, seed=0)(logits) == int(logits.argmax())


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**63 - 1, 2**64 + 5])
def test_every_int_seed_is_accepted_and_deterministic(seed):
    logits = torch.linspace(0, 1, 50)
    first, second = Sampler(1.0, 1.0, seed), Sampler(1.0, 1.0, seed)
    assert [first(logits) for _ in range(10)] == [second(logits) for _ in range(10)]


@pytest.mark.parametrize("seed", [0, 7, 2**63 - 1])
def test_seeds_that_differ_only_above_bit_31_sample_differently(seed):
    logits = torch.zeros(1000)
    draws = [Sampler(1.0, 1.0, seed + k * 2**32) for k in range(4)]
    samples = [tuple(sampler(logits) for _ in range(8)) for sampler in draws]
    assert len(set(samples)) == 4


def test_seeds_below_2_to_the_32_reach_the_generator_unchanged():
    assert [generator_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    assert generator_seed(-1) == generator_seed(2**64 - 1)
