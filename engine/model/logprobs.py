"""Log-probabilities of chosen tokens and of the most likely tokens beside them, from logits:
what a request that asks for logprobs gets back (nothing is computed for one that does not)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A log-probability of -inf (a token that a tiny temperature rules out) as JSON can carry it,
# OpenAI's and vLLM's stand-in.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Logprobs:
    """Per position: the chosen token and its log-probability, and the `top_n` most likely
    tokens with theirs, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @classmethod
    def concat(cls, parts: list[Logprobs]) -> Logprobs:
        return cls(
            [t for p in parts for t in p.token_ids],
            [x for p in parts for x in p.logprobs],
            [t for p in parts for t in p.top_ids],
            [x for p in parts for x in p.top_logprobs],
        )


def logprobs_of(logits: torch.Tensor, chosen: Sequence[int], top_n: int) -> Logprobs:
    """The log-softmax of `logits` [N, V] (any float dtype; float32 at least is used) at the
    `chosen` token of each row, and each row's `top_n` best; one read-back for all rows."""
    assert top_n >= 0 and logits.shape[0] == len(chosen)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1).clamp_min(LOGPROB_FLOOR)  # [N, V]
    index = torch.tensor(list(chosen), dtype=torch.long, device=logits.device)
    picked = logp.gather(-1, index[:, None])[:, 0]  # [N]
    top_values, top_ids = logp.topk(top_n, dim=-1)  # [N, top_n]
    return Logprobs(
        token_ids=list(chosen),
        logprobs=picked.tolist(),
        top_ids=top_ids.tolist(),
        top_logprobs=top_values.tolist(),
    )
