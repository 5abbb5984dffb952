"""Answer held-out questions with the engine in one mode and score them (exact match, F1, KV
deviation from full prefill); shared by bench/quality.py and tests/demo."""

from __future__ import annotations

import hashlib
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.types import Chunk, GenerateRequest, Mode

_PUNCTUATION = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def f1_score(prediction: str, answer: str) -> float:
    predicted, gold = normalize(prediction).split(), normalize(answer).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def as_chunks(passages: Sequence[str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(hashlib.sha256(p.encode()).hexdigest()[:16], p) for p in passages)


@dataclass(frozen=True)
class Config:
    """One way of building the prompt's KV: a mode and, for cacheblend, its ratio."""

    mode: Mode
    recompute_ratio: float | None = None

    @property
    def label(self) -> str:
        if self.mode is Mode.CACHEBLEND:
            return f"cacheblend@{self.recompute_ratio:g}"
        return self.mode.value


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


def kv_deviation(keys, values, ref_keys, ref_values, spans) -> float:
    """Σ‖ΔK‖²+‖ΔV‖² over chunk tokens and all layers, relative to the reference's Σ‖K‖²+‖V‖²."""
    index = torch.cat([torch.arange(s, s + n) for s, n in spans]) if spans else None
    if index is None:
        return 0.0
    # keys, values: [L, H_kv, T, D]
    k, v = keys[:, :, index].float(), values[:, :, index].float()
    rk, rv = ref_keys[:, :, index].float(), ref_values[:, :, index].float()
    num = (k - rk).pow(2).sum() + (v - rv).pow(2).sum()
    return float(num / (rk.pow(2).sum() + rv.pow(2).sum()))


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
                deviation = kv_deviation(
                    prefill.output.keys,
                    prefill.output.values,
                    reference.output.keys,
                    reference.output.values,
                    reference.layout.chunk_spans,
                )
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
