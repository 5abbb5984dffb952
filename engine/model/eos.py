"""Which token ids end a generation: the tokenizer's EOS and the model's configured ones."""

from __future__ import annotations

from transformers import PreTrainedModel


def eos_token_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids
