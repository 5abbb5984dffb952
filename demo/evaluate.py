"""Answer held-out questions with the engine in one mode and score them (exact match, F1, KV
deviation from full prefill); shared by bench/quality.py and tests/demo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.types import GenerateRequest, Mode
from evaluation.deviation import prefill_deviation
from evaluation.metrics import exact_match, f1_score, normalize
from evaluation.runner import Setting as Config
from evaluation.runner import as_chunks

# Imported from here by bench/quality.py and tests/demo.
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
        if reference is not None:
            prefill = reference
            if config.mode is not Mode.FULL_PREFILL:
                prefill = engine.prefill(request)
                deviation = prefill_deviation(prefill, reference)
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
            )
        )
    return outcomes
