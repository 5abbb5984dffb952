"""Teacher-forced deviation from full prefill: full prefill's greedy answer fed after another
setting's prompt KV, next-token distributions compared at every answer position."""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from engine.agreement import AnswerDeviation, answer_deviation
from engine.prefill import Prefill

__all__ = ["ANSWER_TOKENS", "AnswerDeviation", "answer_logits", "greedy_answer", "teacher_forced"]

# Answer tokens compared per prompt: enough positions to see the KV's effect beyond the first
# token, few enough that a 16-token forward costs a fraction of a prefill.
ANSWER_TOKENS = 16


def cache_keyword(model: PreTrainedModel) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache`, older 5.x releases
    `past_key_values` (the one deprecated in the newer ones)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache(model: PreTrainedModel, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
    """A DynamicCache holding keys/values [L, H_kv, T, D] (post-RoPE) as a batch of one."""
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    return cache


@torch.inference_mode()
def _forward(model: PreTrainedModel, cache: DynamicCache, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of the tokens fed after the cache's positions;
    the cache grows by them."""
    ids = torch.tensor([list(token_ids)], device=model.device)
    out = model(ids, use_cache=True, **{cache_keyword(model): cache})
    return out.logits[0].float()


def _prompt_cache(model: PreTrainedModel, prefill: Prefill) -> tuple[DynamicCache, int]:
    """The prompt's KV without its last position, and the prompt's last token. The last position
    is computed in full by every mode (it belongs to the suffix), so recomputing it here over the
    setting's KV gives what the setting gave, and every answer position's logits come from one
    forward."""
    output, last = prefill.output, prefill.layout.token_ids[-1]
    end = prefill.layout.num_tokens - 1
    return _cache(model, output.keys[:, :, :end], output.values[:, :, :end]), last


def greedy_answer(
    model: PreTrainedModel,
    reference: Prefill,
    eos_ids: Collection[int],
    max_tokens: int = ANSWER_TOKENS,
) -> list[int]:
    """Full prefill's greedy continuation of its prompt: up to `max_tokens` tokens, ending
    early with (and including) an end-of-sequence token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    cache, token = _prompt_cache(model, reference)
    answer: list[int] = []
    while len(answer) < max_tokens and (not answer or answer[-1] not in eos_ids):
        token = int(_forward(model, cache, [token])[-1].argmax())
        answer.append(token)
    return answer


def answer_logits(model: PreTrainedModel, prefill: Prefill, answer: Sequence[int]) -> torch.Tensor:
    """Next-token logits [len(answer), vocab] at each answer position, the answer fed after the
    prefill's prompt KV (position j predicts answer[j] from answer[:j])."""
    if not answer:
        raise ValueError("no answer tokens to feed")
    cache, last = _prompt_cache(model, prefill)
    return _forward(model, cache, [last, *answer[:-1]])


def teacher_forced(
    model: PreTrainedModel, reference_logits: torch.Tensor, prefill: Prefill, answer: Sequence[int]
) -> AnswerDeviation:
    """KL(full ‖ setting) per answer position and argmax agreement, `reference_logits` being
    answer_logits() of full prefill for the same answer."""
    return answer_deviation(reference_logits, answer_logits(model, prefill, answer))
