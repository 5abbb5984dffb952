"""Prompt layout `prefix | chunk_1 | ... | chunk_n | suffix` and the chunk-precompute prefix.

Every chunk is tokenized on its own, so its tokens (and hence its KV key) do not depend on its
neighbours or its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from jinja2 import TemplateError

from engine.errors import PromptTooLongError
from engine.types import ChunkOrder, GenerateRequest

# The demo model (demo/) was trained on prompts with exactly this system prompt and instruction:
# change either and its weights answer worse. tests/demo/test_demo_quality.py and
# test_demo_train.py catch such a drift; retrain the demo (demo/README.md) when changing them.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
INSTRUCTION = "Answer the question using the passages below."
CHUNK_SEPARATOR = "\n\n"
_PASSAGES_SLOT = "\u2063RAGBLEND_PASSAGES\u2063"
# A chunk's tokens and its cache salt: what its KV key is made of.
SaltedChunk = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class PromptLayout:
    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]
    dropped_chunks: int = 0  # left out from the end by fitted()
    # Each chunk's cache salt (its KV key's scope, kvstore.types.chunk_key); empty: none salted.
    chunk_salts: tuple[str, ...] = ()
    # The request's cache salt: the scope of its prefix's cached KV (engine/prefix_cache.py).
    cache_salt: str = ""

    def __post_init__(self) -> None:
        assert not self.chunk_salts or len(self.chunk_salts) == len(self.chunks)

    @property
    def salted_chunks(self) -> list[SaltedChunk]:
        """(tokens, cache salt) of each chunk: what its KV key is made of."""
        salts = self.chunk_salts or ("",) * len(self.chunks)
        return list(zip(self.chunks, salts, strict=True))

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return self.prefix + sum(self.chunks, ()) + self.suffix

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @cached_property
    def chunk_spans(self) -> tuple[tuple[int, int], ...]:
        """(start position, length) of each chunk in the whole prompt."""
        spans, start = [], len(self.prefix)
        for chunk in self.chunks:
            spans.append((start, len(chunk)))
            start += len(chunk)
        return tuple(spans)

    def fitted(self, max_tokens: int) -> PromptLayout:
        """This layout with chunks dropped from the end until it has at most `max_tokens`
        tokens; prefix and suffix always stay, so the result may still be longer."""
        chunks, total = list(self.chunks), self.num_tokens
        while chunks and total > max_tokens:
            total -= len(chunks.pop())
        dropped = self.dropped_chunks + len(self.chunks) - len(chunks)
        salts = self.chunk_salts[: len(chunks)]
        return replace(self, chunks=tuple(chunks), dropped_chunks=dropped, chunk_salts=salts)

    def reversed(self) -> PromptLayout:
        """The same chunks in reverse order (each chunk's tokens, hence its KV key, unchanged)."""
        return replace(self, chunks=self.chunks[::-1], chunk_salts=self.chunk_salts[::-1])


class PromptBuilder:
    """Lays out prompts with the tokenizer's chat template, or a plain template without one."""

    def __init__(self, tokenizer, default_system: str = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.uses_chat_template = bool(getattr(tokenizer, "chat_template", None))
        boundary = tokenizer.bos_token_id
        if boundary is None:
            # Tokenizers without BOS (Qwen) still need one fixed token before every chunk.
            boundary = tokenizer.eos_token_id
        if boundary is None:
            raise ValueError(
                "the tokenizer has neither a BOS nor an EOS token to start chunks with"
            )
        self.chunk_prefix: tuple[int, ...] = (boundary,)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chunk_tokens(self, text: str) -> tuple[int, ...]:
        """The tokens of one chunk as it appears in every prompt (separator included)."""
        return self.encode(text.strip() + CHUNK_SEPARATOR)

    def build(
        self, question: str, chunk_texts: Sequence[str], system: str | None = None
    ) -> PromptLayout:
        prefix_text, suffix_text = self._frame(question, system or self.default_system)
        chunks = tuple(self.chunk_tokens(text) for text in chunk_texts)
        return PromptLayout(self.encode(prefix_text), chunks, self.encode(suffix_text))

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _frame(self, question: str, system: str) -> tuple[str, str]:
        """The text before and after the passages."""
        if self.uses_chat_template:
            user = f"{_PASSAGES_SLOT}Question: {question.strip()}"
            instruction = f"{system}\n{INSTRUCTION}"
            try:
                rendered = self._render(
                    [{"role": "system", "content": instruction}, {"role": "user", "content": user}]
                )
            except TemplateError:
                # Some templates (Mistral's) refuse a system turn: it goes first in the user turn.
                rendered = self._render([{"role": "user", "content": f"{instruction}\n\n{user}"}])
            prefix, slot, suffix = rendered.partition(_PASSAGES_SLOT)
            assert slot, "the chat template dropped the user message"
            return prefix, suffix
        bos = self.tokenizer.bos_token or ""
        return f"{bos}{system}\n{INSTRUCTION}\n\n", f"Question: {question.strip()}\nAnswer:"


def request_layout(
    prompts: PromptBuilder, request: GenerateRequest, max_model_len: int
) -> PromptLayout:
    """The request's prompt (with `fit_context`, chunks dropped from the end until it fits;
    then, with chunk_order best_last, the kept chunks reversed), checked by `fitting`."""
    layout = prompts.build(request.question, [c.text for c in request.chunks], request.system)
    salts = tuple(c.cache_salt for c in request.chunks)
    if any(salts) or request.cache_salt:
        layout = replace(
            layout, chunk_salts=salts if any(salts) else (), cache_salt=request.cache_salt
        )
    if request.fit_context:
        layout = layout.fitted(max_model_len - request.max_tokens)
    if request.chunk_order is ChunkOrder.BEST_LAST:
        layout = layout.reversed()
    return fitting(layout, request.max_tokens, max_model_len)


def fitting(layout: PromptLayout, max_tokens: int, max_model_len: int) -> PromptLayout:
    """`layout`, or PromptTooLongError when it and max_tokens exceed `max_model_len`."""
    if layout.num_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"prompt has {layout.num_tokens} tokens and max_tokens is {max_tokens}: "
            f"more than the engine's maximum of {max_model_len} positions"
        )
    return layout
