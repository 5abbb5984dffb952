"""Prompts in several settings, each run by an engine of its own over one model and KV store:
every setting's teacher-forced deviation from full prefill and its prefill time."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from engine.blend.prefill import Prefill
from engine.blend.selection import Selection
from engine.engine import Engine
from engine.quality.agreement import AnswerDeviation, answer_deviation
from engine.quality.oracle import Oracle, OracleScores, oracle_scores
from engine.types import Chunk, GenerateRequest, Mode
from evaluation.teacher_forcing import ANSWER_TOKENS, answers_logits, greedy_answers
from kvstore.types import ChunkKV


@dataclass(frozen=True)
class Variant:
    """A setting: a mode, ratio and selection on an engine whose own settings (check layers,
    default selection) complete it; `oracle` ranks the tokens by an oracle's scores instead
    (engine/oracle.py). Every variant's engine shares the reference engine's model and store."""

    label: str
    engine: Engine
    mode: Mode
    recompute_ratio: float | Literal["auto"] | None = None
    selection: Selection | None = None
    oracle: Oracle | None = None


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


@dataclass(frozen=True)
class Case:
    """A prompt and the settings to compare on it."""

    question: str
    passages: Sequence[str]
    variants: Sequence[Variant]


# Prompts whose full prefills are kept to decode their greedy answers as one batch, and
# prefills whose answer logits are computed as one batch: the forward of one token reads every
# weight (memory-bound on a CPU), a batch of 8 costs little more; 8 prompts' KV of ~600 tokens
# is ~200 MB on SmolLM2 in float32.
BATCH = 8


def compare_prompts(
    reference: Engine, cases: Sequence[Case], answer_tokens: int = ANSWER_TOKENS
) -> Iterator[PromptResult]:
    """Each case's result, in order: its passages' KV precomputed, full prefill on `reference`
    and its greedy answer, then every variant's prefill compared with it. Prefills run on the
    calling thread, outside the engines' serving loops."""
    for start in range(0, len(cases), BATCH):
        group = cases[start : start + BATCH]
        fulls = [_full_prefill(reference, case) for case in group]
        answers = greedy_answers(reference.model, fulls, reference.eos_ids, answer_tokens)
        for case, full, answer in zip(group, fulls, answers, strict=True):
            yield _compare(reference, case, full, answer)


def _request(
    case: Case,
    mode: Mode,
    ratio: float | Literal["auto"] | None,
    selection: Selection | None = None,
) -> GenerateRequest:
    chunks = as_chunks(case.passages)
    return GenerateRequest(
        question=case.question,
        chunks=chunks,
        mode=mode,
        recompute_ratio=ratio,
        selection=selection,
    )


def _prefill(variant: Variant, case: Case, oracles: OracleScores | None) -> Prefill:
    request = _request(case, variant.mode, variant.recompute_ratio, variant.selection)
    if variant.oracle is None:
        return variant.engine.prefill(request)
    assert oracles is not None
    return variant.engine.prefill(request, oracles.by_oracle[variant.oracle])


def _chunk_kv(reference: Engine, tokens: tuple[int, ...]) -> ChunkKV:
    """The chunk's KV as precomputed into the store's memory tier (computed again if evicted)."""
    stored = reference.store.get_local(reference.chunk_key(tokens))
    return stored if stored is not None else reference.prefiller.compute_chunk_kv(tokens)


def _oracles(reference: Engine, full: Prefill, answer: list[int]) -> OracleScores:
    """The oracle scores of a prompt: its full prefill's answer appended, every chunk blended."""
    layout = full.layout
    return oracle_scores(
        reference.ops,
        layout.token_ids + tuple(answer),
        layout.chunk_spans,
        [_chunk_kv(reference, tokens) for tokens in layout.chunks],
        full.plan.suffix_start,
    )


def _full_prefill(reference: Engine, case: Case) -> Prefill:
    reference.precompute(as_chunks(case.passages))
    return reference.prefill(_request(case, Mode.FULL_PREFILL, None))


def _compare(reference: Engine, case: Case, full: Prefill, answer: list[int]) -> PromptResult:
    model = reference.model
    full_logits: torch.Tensor | None = None
    by_label: dict[str, Measured] = {}
    wanted = any(v.oracle is not None for v in case.variants)
    oracles = _oracles(reference, full, answer) if wanted else None
    # Batches of BATCH rows, full prefill's row first in the first one.
    for start in range(0, len(case.variants), BATCH - 1):
        variants = case.variants[start : start + BATCH - 1]
        for variant in variants:
            assert variant.engine.model is model, "variants share the reference's model"
        prefills = [_prefill(v, case, oracles) for v in variants]
        rows = prefills if full_logits is not None else [full, *prefills]
        logits = list(answers_logits(model, rows, answer))
        if full_logits is None:
            full_logits = logits.pop(0)
        for variant, prefill, row in zip(variants, prefills, logits, strict=True):
            by_label[variant.label] = Measured(
                answer_deviation(full_logits, row),
                prefill.prefill_s,
                prefill.usage.recomputed_tokens,
            )
    return PromptResult(full.prefill_s, tuple(answer), full.layout.num_tokens, by_label)
