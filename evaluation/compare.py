"""One prompt in several settings, each run by an engine of its own over one model and KV store:
every setting's teacher-forced deviation from full prefill and its prefill time."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from engine.agreement import AnswerDeviation
from engine.engine import Engine
from engine.types import Chunk, GenerateRequest, Mode
from evaluation.teacher_forcing import ANSWER_TOKENS, answer_logits, greedy_answer, teacher_forced


@dataclass(frozen=True)
class Variant:
    """A setting: a mode (and ratio) on an engine whose own settings (selection, check layers)
    complete it. Every variant's engine shares the reference engine's model and store."""

    label: str
    engine: Engine
    mode: Mode
    recompute_ratio: float | None = None


@dataclass(frozen=True)
class Measured:
    deviation: AnswerDeviation
    prefill_s: float  # the prompt's prefill, chunks cached in RAM: what its TTFT is made of
    recomputed_tokens: int


@dataclass(frozen=True)
class PromptResult:
    reference_prefill_s: float
    answer: tuple[int, ...]  # full prefill's greedy answer, the tokens fed to every setting
    prompt_tokens: int
    by_label: dict[str, Measured]


def as_chunks(passages: Sequence[str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(hashlib.sha256(p.encode()).hexdigest()[:16], p) for p in passages)


def compare_prompt(
    reference: Engine,
    question: str,
    passages: Sequence[str],
    variants: Sequence[Variant],
    answer_tokens: int = ANSWER_TOKENS,
) -> PromptResult:
    """Precompute the passages' KV, run full prefill on `reference` and take its greedy answer,
    then prefill the prompt in every variant and compare. Prefills run on the calling thread,
    outside the engines' serving loops."""
    chunks = as_chunks(passages)
    reference.precompute(chunks)

    def request(mode: Mode, ratio: float | None) -> GenerateRequest:
        return GenerateRequest(question=question, chunks=chunks, mode=mode, recompute_ratio=ratio)

    full = reference.prefill(request(Mode.FULL_PREFILL, None))
    model = reference.model
    answer = greedy_answer(model, full, reference.eos_ids, answer_tokens)
    full_logits = answer_logits(model, full, answer)
    by_label: dict[str, Measured] = {}
    for variant in variants:
        assert variant.engine.model is model, "variants share the reference's model"
        prefill = variant.engine.prefill(request(variant.mode, variant.recompute_ratio))
        by_label[variant.label] = Measured(
            teacher_forced(model, full_logits, prefill, answer),
            prefill.prefill_s,
            prefill.usage.recomputed_tokens,
        )
    return PromptResult(full.prefill_s, tuple(answer), full.layout.num_tokens, by_label)
