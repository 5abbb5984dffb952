"""The shadow's agreement measures: first token, top-k overlap, KL(full || blend), the agreeing
prefix of greedy continuations."""

from __future__ import annotations

import math

import pytest
import torch

from engine.quality.agreement import (
    first_token_agrees,
    greedy_agreement,
    kl_divergence,
    topk_agreement,
)


def test_first_token_agreement_compares_the_argmax_only():
    assert first_token_agrees(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([2.0, 9.0, -4.0]))
    assert not first_token_agrees(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 1.0, 3.0]))


def test_topk_agreement_is_the_overlap_of_the_top_sets_whatever_their_order():
    full = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    assert topk_agreement(full, torch.tensor([4.0, 5.0, 3.0, 0.0, 0.0]), k=3) == 1.0
    one_shared = torch.tensor([5.0, 0.0, 0.0, 4.0, 3.0])
    assert topk_agreement(full, one_shared, k=3) == pytest.approx(1 / 3)
    assert topk_agreement(full, -full, k=2) == 0.0
    assert topk_agreement(full, full, k=100) == 1.0  # k capped at the vocabulary


def test_kl_divergence_is_zero_for_equal_logits_and_matches_the_definition():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, logits + 7.0) == pytest.approx(0.0, abs=1e-12)  # shift-free
    p, q = [0.5, 0.25, 0.25], [0.7, 0.2, 0.1]
    expected = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    got = kl_divergence(torch.tensor(p).log(), torch.tensor(q).log())
    assert got == pytest.approx(expected, rel=1e-6)
    assert kl_divergence(torch.tensor(q).log(), torch.tensor(p).log()) != pytest.approx(got)


def test_greedy_agreement_is_the_agreeing_prefix_over_the_tokens_compared():
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert greedy_agreement([9, 2, 3, 4], [1, 2, 3, 4]) == 0.0  # agreeing after a split is chance
    with pytest.raises(ValueError, match="no greedy tokens"):
        greedy_agreement([1], [])
