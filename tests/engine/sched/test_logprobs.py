"""Logprobs of generated and prompt tokens: equal to the model's own forward (transformers) on a
tiny float32 checkpoint, of the distribution actually sampled from, and the blend's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.blend import loop
from engine.errors import InvalidRequestError
from engine.types import GenerateRequest, Mode

PROMPT = "alpha beta gamma delta epsilon zeta eta theta"
ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(engine_for):
    return engine_for("llama")


@pytest.fixture(scope="module")
def hf_model(checkpoint_dir):
    return AutoModelForCausalLM.from_pretrained(checkpoint_dir("llama"), dtype=torch.float32).eval()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32: position p's logits predict token p + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def raw(**fields) -> GenerateRequest:
    return GenerateRequest(question=PROMPT, raw_prompt=True, mode=Mode.FULL_PREFILL, **fields)


@pytest.mark.parametrize("rows", [3, 256])
def test_prompt_logprobs_of_a_full_prefill_equal_the_model_forward(
    engine, hf_model, monkeypatch, rows
):
    # 3: the prompt's logits are computed in pieces of 3 positions.
    monkeypatch.setattr(loop, "PROMPT_LOGITS_ROWS", rows)
    result = engine.generate(raw(max_tokens=1, prompt_logprobs=3))
    entries = result.prompt_logprobs
    assert entries is not None
    prompt = [e.token_id for e in entries]
    assert prompt == list(engine.tokenizer(PROMPT)["input_ids"])
    assert entries[0].logprob is None and entries[0].top == ()
    expected = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)
    for p, entry in enumerate(entries[1:], start=1):
        assert entry.logprob == pytest.approx(float(expected[p - 1, entry.token_id]), abs=ATOL)
        top = expected[p - 1].topk(3)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=ATOL)
        assert entry.token == engine.tokenizer.decode([entry.token_id])


def test_greedy_logprobs_equal_the_model_forward_over_prompt_and_output(engine, hf_model):
    result = engine.generate(raw(max_tokens=6, logprobs=4, ignore_eos=True))
    assert result.logprobs is not None and len(result.logprobs) == 6
    generated = [e.token_id for e in result.logprobs]
    assert generated == result.token_ids
    prompt = list(engine.tokenizer(PROMPT)["input_ids"])
    logits = hf_logits(hf_model, prompt + generated)
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for row, entry in zip(expected, result.logprobs, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=ATOL)
        # Greedy: the chosen token is the most likely one.
        assert entry.top[0].token_id == entry.token_id
        top = row.topk(4).values.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top, abs=ATOL)


def test_logprobs_are_of_the_distribution_sampled_from_after_penalty_and_temperature(
    engine, hf_model
):
    temperature, presence = 0.7, 1.5
    result = engine.generate(
        raw(
            max_tokens=5,
            logprobs=2,
            ignore_eos=True,
            temperature=temperature,
            seed=3,
            presence_penalty=presence,
        )
    )
    assert result.logprobs is not None
    generated = [e.token_id for e in result.logprobs]
    prompt = list(engine.tokenizer(PROMPT)["input_ids"])
    logits = hf_logits(hf_model, prompt + generated)[len(prompt) - 1 : -1]
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    for row, entry in zip(logits, result.logprobs, strict=True):
        sampled_from = torch.log_softmax((row - presence * seen) / temperature, dim=-1)
        assert entry.logprob == pytest.approx(float(sampled_from[entry.token_id]), abs=ATOL)
        # Not the model's own distribution: the penalty and temperature changed it.
        assert entry.logprob != pytest.approx(
            float(torch.log_softmax(row, -1)[entry.token_id]), abs=1e-3
        )
        seen[entry.token_id] = True


def test_cacheblend_logprobs_are_the_blends_own(engine, make_chunks):
    chunks = make_chunks(3, seed=11)
    engine.precompute(chunks)
    request = GenerateRequest(
        question="which word comes first?", chunks=chunks, recompute_ratio=0.15, max_tokens=1
    )
    blended = engine.prefill(request).output.logits
    full = engine.prefill(GenerateRequest(request.question, chunks, mode=Mode.FULL_PREFILL))
    assert not torch.allclose(blended, full.output.logits, atol=1e-3)
    result = engine.generate(
        GenerateRequest(request.question, chunks, max_tokens=1, logprobs=0, recompute_ratio=0.15)
    )
    assert result.logprobs is not None
    (entry,) = result.logprobs
    own = torch.log_softmax(blended, dim=-1)[entry.token_id]
    assert entry.logprob == pytest.approx(float(own), abs=ATOL)
    assert entry.top == ()


def test_nothing_is_computed_for_a_request_that_does_not_ask(engine):
    result = engine.generate(raw(max_tokens=2))
    assert result.logprobs is None and result.prompt_logprobs is None


def test_prompt_logprobs_need_full_prefill(engine):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs needs mode full_prefill"):
        GenerateRequest(question=PROMPT, raw_prompt=True, prompt_logprobs=1)


def test_more_than_twenty_top_logprobs_are_refused():
    with pytest.raises(InvalidRequestError, match="logprobs must be in"):
        GenerateRequest(question=PROMPT, logprobs=21)


def test_a_prompt_of_token_ids_is_served_as_it_is(engine):
    ids = tuple(engine.tokenizer(PROMPT)["input_ids"])
    by_ids = engine.generate(
        GenerateRequest(question="", prompt_token_ids=ids, mode=Mode.FULL_PREFILL, max_tokens=3)
    )
    by_text = engine.generate(raw(max_tokens=3))
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(InvalidRequestError, match="vocabulary size"):
        engine.layout(GenerateRequest(question="", prompt_token_ids=(10**7,)))
