"""The bitmask arithmetic: bit i of word j allows token 32j + i, and only the masked rows of a
batch change."""

from __future__ import annotations

import pytest
import torch

from engine.grammar.mask import apply_bitmask, bitmask_words


def bitmask_of(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    """The int32 bitmask of each row's allowed token ids, written bit by bit."""
    words = torch.zeros(len(allowed), bitmask_words(vocab_size), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    # Bit 31 set is a negative int32: wrap as the libraries write it.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_a_vocab_not_a_multiple_of_32_gets_the_words_that_cover_it():
    assert bitmask_words(32) == 1
    assert bitmask_words(33) == 2
    assert bitmask_words(49152) == 1536


def test_masked_rows_keep_exactly_their_allowed_tokens_and_other_rows_are_untouched():
    vocab = 70  # three words, the last one partly used
    logits = torch.randn(3, vocab)
    allowed = [{0, 31, 32, 63, 69}, {5}]
    masked = apply_bitmask(logits, bitmask_of(allowed, vocab), torch.tensor([2, 0]))
    for row, tokens in ((2, allowed[0]), (0, allowed[1])):
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert kept == sorted(tokens)
        assert torch.equal(masked[row, sorted(tokens)], logits[row, sorted(tokens)])
    assert torch.equal(masked[1], logits[1])


def test_the_models_logits_are_left_as_they_were():
    logits = torch.randn(1, 40)
    before = logits.clone()
    apply_bitmask(logits, bitmask_of([{3}], 40), torch.tensor([0]))
    assert torch.equal(logits, before)


def test_half_precision_logits_are_masked_in_their_own_dtype():
    logits = torch.randn(1, 64, dtype=torch.bfloat16)
    masked = apply_bitmask(logits, bitmask_of([{1, 62}], 64), torch.tensor([0]))
    assert masked.dtype == torch.bfloat16
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [1, 62]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_logits_on_a_cuda_device_are_masked_there_as_on_the_cpu():
    vocab = 49152
    logits = torch.randn(2, vocab, dtype=torch.bfloat16)
    bitmask = bitmask_of([{0, 7, 49151}, set(range(0, vocab, 3))], vocab)
    rows = torch.tensor([1, 0])
    on_cpu = apply_bitmask(logits, bitmask, rows)
    on_cuda = apply_bitmask(logits.cuda(), bitmask, rows)
    assert on_cuda.device.type == "cuda"
    assert torch.equal(on_cuda.cpu(), on_cpu)
