"""Decoding from a blended prompt cache: it becomes a transformers DynamicCache and the
model's own forward extends it one token at a time."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from engine.detokenize import IncrementalText
from engine.errors import GenerationCancelled
from engine.sampling import Sampler
from engine.types import TokenDelta


def to_dynamic_cache(
    model: PreTrainedModel, keys: torch.Tensor, values: torch.Tensor
) -> DynamicCache:
    """Wrap prompt KV [L, H_kv, T, D] (post-RoPE) as the cache the model's forward expects."""
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    return cache


def cache_keyword(model: PreTrainedModel) -> str:
    """Newer transformers name the forward argument `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eos_token_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids


class Decoder:
    """Yields TokenDeltas until EOS, a stop string or max_tokens; then `finish_reason` is set."""

    def __init__(self, model: PreTrainedModel, tokenizer, eos_ids: set[int]):
        self.model = model
        self.eos_ids = eos_ids
        self.text = IncrementalText(tokenizer)
        self.finish_reason = "length"
        self.first_token_at: float | None = None
        self._cache_kw = cache_keyword(model)

    @torch.inference_mode()
    def run(
        self,
        cache: DynamicCache,
        logits: torch.Tensor,
        sampler: Sampler,
        max_tokens: int,
        stop: tuple[str, ...],
        cancelled: Callable[[], bool],
    ) -> Iterator[TokenDelta]:
        self.text.stop = stop
        device = self.model.device
        for step in range(max_tokens):
            if cancelled():
                raise GenerationCancelled
            token = sampler(logits)
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            piece = self.text.add(token)
            if self.text.stopped:
                self.finish_reason = "stop"
                yield TokenDelta(piece, token)
                return
            yield TokenDelta(piece, token)
            if step + 1 < max_tokens:
                out = self.model(
                    input_ids=torch.tensor([[token]], device=device),
                    use_cache=True,
                    **{self._cache_kw: cache},
                )
                logits = out.logits[0, -1].float()
        tail = self.text.flush()
        if tail:
            yield TokenDelta(tail, None)
