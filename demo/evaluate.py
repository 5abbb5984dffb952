"""Answer held-out questions with the engine in one mode and score them (exact match, F1, KV
and teacher-forced deviation from full prefill); shared by research/quality.py and tests/demo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.types import GenerateRequest, Mode
from evaluation.deviation import prefill_deviation
from evaluation.metrics import exact_match, f1_score, normalize
from evaluation.runner import Setting as Config
from evaluation.runner import as_chunks
from evaluation.teacher_forcing import answer_logits, greedy_answer, teacher_forced

# Imported from here by research/quality.py and tests/demo.
__all__ = [
    "Config",
    "EvalResult",
    "answer",
    "as_chunks",
    "exact_match",
    "f1_score",
    "normalize",
]


@dataclass(frozen=True)
class EvalResult:
    config: Config
    prediction: str
    exact_match: float
    f1: float
    kv_deviation: float  # relative squared deviation of chunk-token K/V from full prefill
    ttft_s: float
    # log-probability of the gold answer's first token after the prompt (nan: not measured)
    gold_logprob: float = float("nan")
    # teacher-forced: full prefill's greedy answer fed after this config's KV (nan: not measured)
    tf_kl: float = float("nan")
    tf_argmax_agreement: float = float("nan")


def answer(
    engine: Engine,
    question: str,
    gold_answer: str,
    passages: Sequence[str],
    configs: Sequence[Config],
    max_tokens: int = 12,
    measure_deviation: bool = True,
) -> list[EvalResult]:
    """Answer one question in every config; the chunks' KV is precomputed first."""
    chunks = as_chunks(passages)
    engine.precompute(chunks)
    reference = None
    if measure_deviation:
        full = GenerateRequest(question=question, chunks=chunks, mode=Mode.FULL_PREFILL)
        reference = engine.prefill(full)
        forced_answer = greedy_answer(engine.model, reference, engine.eos_ids)
        reference_logits = answer_logits(engine.model, reference, forced_answer)
    first_token = engine.prompts.encode(gold_answer)[0]
    outcomes = []
    for config in configs:
        request = GenerateRequest(
            question=question,
            chunks=chunks,
            mode=config.mode,
            recompute_ratio=config.recompute_ratio,
            max_tokens=max_tokens,
            temperature=0.0,
        )
        deviation, logprob = 0.0, float("nan")
        tf_kl = tf_agreement = float("nan")
        if reference is not None:
            prefill, tf_kl, tf_agreement = reference, 0.0, 1.0
            if config.mode is not Mode.FULL_PREFILL:
                prefill = engine.prefill(request)
                deviation = prefill_deviation(prefill, reference)
                forced = teacher_forced(engine.model, reference_logits, prefill, forced_answer)
                tf_kl, tf_agreement = forced.kl, forced.argmax_agreement
            logprob = float(prefill.output.logits.float().log_softmax(-1)[first_token])
        result = engine.generate(request)
        outcomes.append(
            EvalResult(
                config,
                result.text.strip(),
                exact_match(result.text, gold_answer),
                f1_score(result.text, gold_answer),
                deviation,
                result.timings.ttft_s,
                logprob,
                tf_kl,
                tf_agreement,
            )
        )
    return outcomes
