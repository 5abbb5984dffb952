"""Answer-quality scores of one prediction against gold answers: exact match, token F1 and
ROUGE-L, over SQuAD-style normalized words; pure Python, no model needed."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

Metric = Callable[[str, str], float]

_PUNCTUATION = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def _f_measure(overlap: int, predicted: int, gold: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / gold
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answer: str) -> float:
    """Harmonic mean of precision and recall of the words both share (as multisets)."""
    predicted, gold = normalize(prediction).split(), normalize(answer).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    return _f_measure(common, len(predicted), len(gold))


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, one row of the table at a time."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(above, row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(prediction: str, answer: str) -> float:
    """ROUGE-L F-measure (β = 1): precision and recall of the longest common subsequence of
    words, so word order counts, unlike F1."""
    predicted, gold = normalize(prediction).split(), normalize(answer).split()
    return _f_measure(_lcs_length(predicted, gold), len(predicted), len(gold))


def best(metric: Metric, prediction: str, answers: Sequence[str]) -> float:
    """The score against the closest of several gold answers."""
    if not answers:
        raise ValueError("no gold answers to score against")
    return max(metric(prediction, answer) for answer in answers)
