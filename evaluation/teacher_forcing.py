"""Teacher-forced deviation from full prefill: full prefill's greedy answer fed after another
setting's prompt KV, next-token distributions compared at every answer position."""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from engine.blend.prefill import Prefill
from engine.quality.agreement import AnswerDeviation, answer_deviation

__all__ = [
    "ANSWER_TOKENS",
    "AnswerDeviation",
    "answer_logits",
    "answers_logits",
    "greedy_answer",
    "greedy_answers",
    "teacher_forced",
]

# Answer tokens compared per prompt: enough positions to see the KV's effect beyond the first
# token, few enough that a 16-token forward costs a fraction of a prefill.
ANSWER_TOKENS = 16


def cache_keyword(model: PreTrainedModel) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache`, older 5.x releases
    `past_key_values` (the one deprecated in the newer ones)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _batch(
    model: PreTrainedModel, prefills: Sequence[Prefill]
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts' KV without their last positions, left-padded into one batch: the cache, its
    attention mask [B, T] (0 on padding), each prompt's last token [B] and that token's
    position [B]. The last position is computed in full by every mode (it belongs to the
    suffix), so recomputing it here over the setting's KV gives what the setting gave, and every
    answer position's logits come from one forward."""
    ends = [p.layout.num_tokens - 1 for p in prefills]
    width = max(ends)
    first = prefills[0].output.keys
    shape = (len(prefills), first.shape[0], first.shape[1], width, first.shape[3])
    keys = first.new_zeros(shape)
    values = first.new_zeros(shape)
    mask = torch.zeros(len(prefills), width, dtype=torch.long, device=first.device)
    for row, (prefill, end) in enumerate(zip(prefills, ends, strict=True)):
        keys[row, :, :, width - end :] = prefill.output.keys[:, :, :end]
        values[row, :, :, width - end :] = prefill.output.values[:, :, :end]
        mask[row, width - end :] = 1
    cache = DynamicCache(config=model.config)
    for layer in range(shape[1]):
        cache.update(keys[:, layer], values[:, layer], layer)
    last = torch.tensor([p.layout.token_ids[-1] for p in prefills], device=first.device)
    return cache, mask, last, torch.tensor(ends, device=first.device)


@torch.inference_mode()
def _forward(
    model: PreTrainedModel,
    cache: DynamicCache,
    mask: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, n, vocab] (float32) of the tokens [B, n] fed at `positions` [B, n] after the
    cache; the cache grows by them. Returns the logits and the mask grown to match."""
    mask = torch.cat([mask, mask.new_ones(token_ids.shape)], dim=1)
    out = model(
        token_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    return out.logits.float(), mask


def greedy_answers(
    model: PreTrainedModel,
    references: Sequence[Prefill],
    eos_ids: Collection[int],
    max_tokens: int = ANSWER_TOKENS,
) -> list[list[int]]:
    """Each full prefill's greedy continuation of its prompt, decoded as one batch: up to
    `max_tokens` tokens, ending early with (and including) an end-of-sequence token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    cache, mask, tokens, positions = _batch(model, references)
    answers: list[list[int]] = [[] for _ in references]
    open_rows = set(range(len(references)))
    for _ in range(max_tokens):
        logits, mask = _forward(model, cache, mask, tokens[:, None], positions[:, None])
        tokens, positions = logits[:, -1].argmax(dim=-1), positions + 1
        for row in sorted(open_rows):
            answers[row].append(int(tokens[row]))
            if answers[row][-1] in eos_ids:
                open_rows.discard(row)
        if not open_rows:
            break
    return answers


def greedy_answer(
    model: PreTrainedModel,
    reference: Prefill,
    eos_ids: Collection[int],
    max_tokens: int = ANSWER_TOKENS,
) -> list[int]:
    """greedy_answers() of one prefill."""
    return greedy_answers(model, [reference], eos_ids, max_tokens)[0]


def answers_logits(
    model: PreTrainedModel, prefills: Sequence[Prefill], answer: Sequence[int]
) -> torch.Tensor:
    """Next-token logits [B, len(answer), vocab] at each answer position, the one answer fed
    after each prefill's prompt KV as one batch (position j predicts answer[j] from
    answer[:j])."""
    if not answer:
        raise ValueError("no answer tokens to feed")
    cache, mask, last, ends = _batch(model, prefills)
    fed = torch.tensor([list(answer[:-1])], device=last.device).expand(len(prefills), -1)
    token_ids = torch.cat([last[:, None], fed], dim=1)
    positions = ends[:, None] + torch.arange(len(answer), device=last.device)
    return _forward(model, cache, mask, token_ids, positions)[0]


def answer_logits(model: PreTrainedModel, prefill: Prefill, answer: Sequence[int]) -> torch.Tensor:
    """answers_logits() of one prefill: [len(answer), vocab]."""
    return answers_logits(model, [prefill], answer)[0]


def teacher_forced(
    model: PreTrainedModel, reference_logits: torch.Tensor, prefill: Prefill, answer: Sequence[int]
) -> AnswerDeviation:
    """KL(full ‖ setting) per answer position and argmax agreement, `reference_logits` being
    answer_logits() of full prefill for the same answer."""
    return answer_deviation(reference_logits, answer_logits(model, prefill, answer))
