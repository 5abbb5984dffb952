"""Answers one question in every setting (mode, recompute ratio, token selection) with an
in-process engine, scoring each answer, its KV cache and its teacher-forced logits against gold
and full prefill."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from common.contract import Selection
from engine.engine import Engine
from engine.types import Chunk, ChunkOrder, GenerateRequest, Mode
from evaluation.dataset import Record
from evaluation.deviation import prefill_deviation
from evaluation.metrics import best, exact_match, f1_score, rouge_l
from evaluation.teacher_forcing import (
    ANSWER_TOKENS,
    AnswerDeviation,
    answer_logits,
    greedy_answer,
    teacher_forced,
)


@dataclass(frozen=True)
class Setting:
    """One way of building the prompt's KV: a mode and, for cacheblend, its ratio and token
    selection (None: the engine's)."""

    mode: Mode
    recompute_ratio: float | None = None
    selection: Selection | None = None

    @property
    def label(self) -> str:
        """e.g. `cacheblend@0.15` (the engine's selection) or `cacheblend@0.15 weighted`."""
        if self.mode is Mode.CACHEBLEND:
            label = f"cacheblend@{self.recompute_ratio:g}"
            return label if self.selection is None else f"{label} {self.selection.value}"
        return self.mode.value


REFERENCE = Setting(Mode.FULL_PREFILL)


def settings_for(
    modes: Sequence[Mode], ratios: Sequence[float], selections: Sequence[Selection] = ()
) -> list[Setting]:
    """Full prefill first (every other setting is compared with it), then each mode in the given
    order, cacheblend once per ratio and selection, ratio by ratio (once per ratio with the
    engine's selection when `selections` is empty)."""
    settings = [REFERENCE]
    picks: list[Selection | None] = list(dict.fromkeys(selections)) or [None]
    for mode in dict.fromkeys(modes):
        if mode is Mode.CACHEBLEND:
            settings.extend(
                Setting(mode, r, selection) for r in dict.fromkeys(ratios) for selection in picks
            )
        elif mode is not Mode.FULL_PREFILL:
            settings.append(Setting(mode))
    return settings


@dataclass(frozen=True)
class Outcome:
    """One question answered in one setting."""

    record_id: str
    kind: str | None
    setting: Setting
    prediction: str
    exact_match: float
    f1: float
    rouge_l: float
    agreement: float  # 1.0: the same answer as full prefill, right or wrong
    kv_deviation: float  # relative squared deviation of chunk-token K/V from full prefill
    # Full prefill's greedy answer fed after this setting's prompt KV: mean KL(full ‖ setting)
    # in nats per answer position, and the share of positions whose argmax agrees.
    tf_kl: float
    tf_argmax_agreement: float
    ttft_s: float


def as_chunks(passages: Sequence[str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(hashlib.sha256(p.encode()).hexdigest()[:16], p) for p in passages)


def request_for(
    record: Record,
    passages: Sequence[str],
    setting: Setting,
    max_tokens: int,
    chunk_order: ChunkOrder = ChunkOrder.BEST_FIRST,
) -> GenerateRequest:
    return GenerateRequest(
        question=record.question,
        chunks=as_chunks(passages),
        mode=setting.mode,
        recompute_ratio=setting.recompute_ratio,
        selection=setting.selection,
        max_tokens=max_tokens,
        temperature=0.0,
        chunk_order=chunk_order,
    )


def answer_record(
    engine: Engine,
    record: Record,
    passages: Sequence[str],
    settings: Sequence[Setting],
    max_tokens: int,
    chunk_order: ChunkOrder = ChunkOrder.BEST_FIRST,
    answer_tokens: int = ANSWER_TOKENS,
) -> list[Outcome]:
    """Answer `record` in every setting (settings[0] is full prefill); the chunks' KV is
    precomputed first, so TTFT is that of chunks cached in RAM. The teacher-forced deviation
    compares the first `answer_tokens` of full prefill's greedy answer."""
    assert settings[0] == REFERENCE, "settings_for() puts full prefill first"
    assert record.id is not None, "load_dataset() gives every record an id"
    engine.precompute(as_chunks(passages))
    reference = engine.prefill(request_for(record, passages, REFERENCE, max_tokens, chunk_order))
    answer = greedy_answer(engine.model, reference, engine.eos_ids, answer_tokens)
    reference_logits = answer_logits(engine.model, reference, answer)
    outcomes: list[Outcome] = []
    for setting in settings:
        request = request_for(record, passages, setting, max_tokens, chunk_order)
        deviation, forced = 0.0, AnswerDeviation(0.0, 1.0, len(answer))
        if setting != REFERENCE:
            prefill = engine.prefill(request)
            deviation = prefill_deviation(prefill, reference)
            forced = teacher_forced(engine.model, reference_logits, prefill, answer)
        result = engine.generate(request)
        prediction = result.text.strip()
        reference_prediction = outcomes[0].prediction if outcomes else prediction
        outcomes.append(
            Outcome(
                record_id=record.id,
                kind=record.kind,
                setting=setting,
                prediction=prediction,
                exact_match=best(exact_match, prediction, record.answers),
                f1=best(f1_score, prediction, record.answers),
                rouge_l=best(rouge_l, prediction, record.answers),
                agreement=float(prediction == reference_prediction),
                kv_deviation=deviation,
                tf_kl=forced.kl,
                tf_argmax_agreement=forced.argmax_agreement,
                ttft_s=result.timings.ttft_s,
            )
        )
    return outcomes
