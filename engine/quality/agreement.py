"""How far a blended prefill's output is from full prefill's: first-token and top-k agreement,
KL of the first logits, agreeing greedy prefix, teacher-forced answer deviation. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def first_token_agrees(full: torch.Tensor, blend: torch.Tensor) -> bool:
    """Whether both logits [vocab] put the same token on top."""
    return int(full.argmax()) == int(blend.argmax())


def topk_agreement(full: torch.Tensor, blend: torch.Tensor, k: int) -> float:
    """|top-k(full) ∩ top-k(blend)| / k, with k capped at the vocabulary: 1 when the k most
    likely tokens are the same set (in any order)."""
    k = min(k, full.numel())
    ours = set(full.topk(k).indices.tolist())
    theirs = set(blend.topk(k).indices.tolist())
    return len(ours & theirs) / k


def kl_divergence(full: torch.Tensor, blend: torch.Tensor) -> float:
    """KL(full ‖ blend) in nats between the next-token distributions at temperature 1: the
    information lost by answering with the blend where full prefill was meant. In float64, so
    that agreeing logits give ~1e-15, not float32 noise; never negative."""
    log_p = torch.log_softmax(full.detach().to("cpu", torch.float64), dim=-1)
    log_q = torch.log_softmax(blend.detach().to("cpu", torch.float64), dim=-1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def greedy_agreement(full: Sequence[int], blend: Sequence[int]) -> float:
    """The agreeing prefix of two greedy continuations, as a share of the blend's: once they
    differ, later tokens continue different texts and agreeing there is chance. 1.0 for
    identical lists; an empty blend has nothing to compare, so ValueError."""
    if not blend:
        raise ValueError("no greedy tokens to compare")
    agreeing = 0
    for ours, theirs in zip(full, blend, strict=False):
        if ours != theirs:
            break
        agreeing += 1
    return agreeing / len(blend)


@dataclass(frozen=True)
class AnswerDeviation:
    """Teacher-forced deviation over an answer: mean KL(full ‖ setting) per answer position
    and the share of positions whose most likely token agrees."""

    kl: float
    argmax_agreement: float
    positions: int


def answer_deviation(full: torch.Tensor, other: torch.Tensor) -> AnswerDeviation:
    """Compare next-token logits [positions, vocab] at the same answer positions: full
    prefill's, and a setting's fed the same answer tokens after its own prompt KV. Computed
    in float64 so that equal logits give ~0, not float32 noise."""
    if full.shape != other.shape or full.dim() != 2 or full.shape[0] == 0:
        raise ValueError(
            f"expected two [positions, vocab] logits of one non-empty shape, got "
            f"{tuple(full.shape)} and {tuple(other.shape)}"
        )
    log_p = torch.log_softmax(full.detach().to("cpu", torch.float64), dim=-1)
    log_q = torch.log_softmax(other.detach().to("cpu", torch.float64), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)
    agree = (log_p.argmax(dim=-1) == log_q.argmax(dim=-1)).double()
    return AnswerDeviation(float(kl.mean()), float(agree.mean()), int(full.shape[0]))
