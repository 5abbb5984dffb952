"""Teacher forcing over a prefill's KV: the answer fed after the prompt's KV gives the logits of
one forward over prompt and answer, the greedy answer is their argmax, deviations compare them."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.types import Chunk, GenerateRequest, Mode
from evaluation.teacher_forcing import (
    answer_logits,
    answers_logits,
    greedy_answer,
    greedy_answers,
    teacher_forced,
)

PASSAGES = ("The river of Dedrem is the Kelmora.", "Tredrer lies on the coast of the north.")


@pytest.fixture(params=["llama", "mistral"])
def engine(request, checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir(request.param), max_num_seqs=1)
    yield engine
    engine.close()


def prefill(
    engine: Engine,
    mode: Mode,
    ratio: float | None = None,
    passages: tuple[str, ...] = PASSAGES,
    question: str = "Which river?",
):
    chunks = tuple(Chunk(f"c{i}", text) for i, text in enumerate(passages))
    engine.precompute(chunks)
    request = GenerateRequest(question=question, chunks=chunks, mode=mode, recompute_ratio=ratio)
    return engine.prefill(request)


def test_answer_logits_are_those_of_one_forward_over_prompt_and_answer(engine):
    full = prefill(engine, Mode.FULL_PREFILL)
    answer = greedy_answer(engine.model, full, engine.eos_ids, max_tokens=6)
    prompt = list(full.layout.token_ids)
    with torch.inference_mode():
        whole = engine.model(torch.tensor([prompt + answer[:-1]])).logits[0].float()
    expected = whole[len(prompt) - 1 :]
    got = answer_logits(engine.model, full, answer)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Greedy: each answer token is the most likely one after the tokens before it.
    assert got.argmax(dim=-1).tolist()[: len(answer)] == answer


def test_greedy_answer_stops_at_max_tokens_or_after_end_of_sequence(engine):
    full = prefill(engine, Mode.FULL_PREFILL)
    answer = greedy_answer(engine.model, full, engine.eos_ids, max_tokens=5)
    assert len(answer) == 5 and not set(answer[:-1]) & engine.eos_ids
    first = answer[0]
    assert greedy_answer(engine.model, full, {first}, max_tokens=5) == [first]
    with pytest.raises(ValueError, match="max_tokens"):
        greedy_answer(engine.model, full, engine.eos_ids, max_tokens=0)


def test_full_prefill_against_itself_is_zero_and_full_reuse_is_not(engine):
    full = prefill(engine, Mode.FULL_PREFILL)
    answer = greedy_answer(engine.model, full, engine.eos_ids, max_tokens=8)
    reference = answer_logits(engine.model, full, answer)
    same = teacher_forced(engine.model, reference, prefill(engine, Mode.CACHEBLEND, 1.0), answer)
    reused = teacher_forced(engine.model, reference, prefill(engine, Mode.FULL_REUSE), answer)
    assert same.kl < 1e-9 and same.argmax_agreement == 1.0 and same.positions == len(answer)
    assert reused.kl > 1e-4


def test_a_batch_of_prompts_of_different_lengths_decodes_as_each_alone(engine):
    prompts = [
        prefill(engine, Mode.FULL_PREFILL),
        prefill(engine, Mode.FULL_PREFILL, passages=PASSAGES[1:], question="Where?"),
        prefill(engine, Mode.FULL_PREFILL, passages=PASSAGES[::-1], question="Which coast is it?"),
    ]
    assert len({p.layout.num_tokens for p in prompts}) == 3, "the batch needs padding"
    alone = [greedy_answer(engine.model, p, engine.eos_ids, max_tokens=6) for p in prompts]
    assert greedy_answers(engine.model, prompts, engine.eos_ids, max_tokens=6) == alone
    # One answer after every prompt: each row is that prompt's answer_logits().
    batched = answers_logits(engine.model, prompts, alone[0])
    for row, p in enumerate(prompts):
        torch.testing.assert_close(
            batched[row], answer_logits(engine.model, p, alone[0]), rtol=1e-4, atol=1e-4
        )
