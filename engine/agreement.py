"""How far a blended prefill's output is from full prefill's: first-token and top-k agreement
and KL divergence of the first logits, agreeing prefix of greedy continuations. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

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
