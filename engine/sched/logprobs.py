"""A request's log-probabilities as the engine hands them out: each token with its text, from
the sampler's distribution for a generated token and the model's own for a prompt token."""

from __future__ import annotations

import torch

from engine.model.logprobs import Logprobs, logprobs_of
from engine.sched.sampling import Sampler
from engine.types import TokenLogprob


def generated_logprob(
    sampler: Sampler, logits: torch.Tensor, token_id: int, top_n: int, tokenizer
) -> TokenLogprob:
    """The sampled `token_id`'s log-probability under the distribution it was drawn from: the
    log-softmax of the penalised `logits` [V] divided by the temperature (greedy: as they are;
    top-p's cut left out, as vLLM's processed logprobs leave it)."""
    found = logprobs_of(sampler.sampled_logits(logits)[None], [token_id], top_n)
    return entries(found, tokenizer)[0]


def prompt_logprobs(token_ids: tuple[int, ...], found: Logprobs, tokenizer) -> list[TokenLogprob]:
    """One entry per prompt token: the first with logprob None (nothing predicts it), then
    the prefill's `found` for tokens 1..T-1."""
    return [TokenLogprob(token_ids[0], _text(tokenizer, token_ids[0]), None)] + entries(
        found, tokenizer
    )


def entries(found: Logprobs, tokenizer) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id,
            _text(tokenizer, token_id),
            logprob,
            tuple(
                TokenLogprob(top_id, _text(tokenizer, top_id), top_logprob)
                for top_id, top_logprob in zip(top_ids, top_logprobs, strict=True)
            ),
        )
        for token_id, logprob, top_ids, top_logprobs in zip(
            found.token_ids, found.logprobs, found.top_ids, found.top_logprobs, strict=True
        )
    ]


def _text(tokenizer, token_id: int) -> str:
    # A byte-level token that is part of a character decodes to U+FFFD, as in vLLM's output.
    return tokenizer.decode([token_id])
