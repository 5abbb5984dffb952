"""Prompt layout `prefix | chunk_1 | ... | chunk_n | suffix` and the chunk-precompute prefix.

Every chunk is tokenized on its own, so its tokens (and hence its KV key) do not depend on its
neighbours or its position. A conversation's earlier turns go in the suffix, always computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from jinja2 import TemplateError

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.types import ChunkOrder, GenerateRequest, Turn

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
    dropped_turns: int = 0  # the oldest turns of the history, left out by fit_prompt()
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

    def raw(self, text: str | None, token_ids: tuple[int, ...] | None) -> PromptLayout:
        """A prompt as it is, no template, system text or chunks: `token_ids`, else `text`
        tokenized with the tokenizer's special tokens (as vLLM's /v1/completions does). All of
        it is the suffix: the prefix cache keys template prefixes, and a raw prompt computes
        every position."""
        if token_ids is None:
            assert text is not None
            token_ids = tuple(self.tokenizer(text)["input_ids"])
        vocab_size = len(self.tokenizer)
        if any(t >= vocab_size for t in token_ids):
            raise InvalidRequestError(
                f"prompt_token_ids: every id must be below the vocabulary size {vocab_size}"
            )
        return PromptLayout((), (), token_ids)

    def chunk_tokens(self, text: str) -> tuple[int, ...]:
        """The tokens of one chunk as it appears in every prompt (separator included)."""
        return self.encode(text.strip() + CHUNK_SEPARATOR)

    def build(
        self,
        question: str,
        chunk_texts: Sequence[str],
        system: str | None = None,
        history: Sequence[Turn] = (),
    ) -> PromptLayout:
        chunks = tuple(self.chunk_tokens(text) for text in chunk_texts)
        return self.frame(question, chunks, system, history)

    def frame(
        self,
        question: str,
        chunks: tuple[tuple[int, ...], ...],
        system: str | None = None,
        history: Sequence[Turn] = (),
        dropped_turns: int = 0,
    ) -> PromptLayout:
        """The prompt around `chunks` (their tokens): `history` (user and assistant alternating,
        engine.types.check_history) goes in the suffix, between the passages and the question."""
        prefix_text, suffix_text = self._frame(question, system or self.default_system, history)
        prefix, suffix = self.encode(prefix_text), self.encode(suffix_text)
        return PromptLayout(prefix, chunks, suffix, dropped_turns=dropped_turns)

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _frame(self, question: str, system: str, history: Sequence[Turn]) -> tuple[str, str]:
        """The text before and after the passages. The passages open the conversation's first
        user turn, so the text before them is the same with or without history (one prefix to
        cache) and every turn after them is suffix."""
        asked = [turn.text.strip() for turn in history] + [question.strip()]
        # Every user turn reads "Question: ...", as the question alone always has.
        texts = [text if i % 2 else f"Question: {text}" for i, text in enumerate(asked)]
        if self.uses_chat_template:
            texts[0] = f"{_PASSAGES_SLOT}{texts[0]}"
            roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(texts))]
            turns = [{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)]
            instruction = f"{system}\n{INSTRUCTION}"
            try:
                rendered = self._render([{"role": "system", "content": instruction}, *turns])
            except TemplateError:
                # Some templates (Mistral's) refuse a system turn: it goes first in the user turn.
                first = {"role": "user", "content": f"{instruction}\n\n{texts[0]}"}
                rendered = self._render([first, *turns[1:]])
            prefix, slot, suffix = rendered.partition(_PASSAGES_SLOT)
            assert slot, "the chat template dropped the user message"
            return prefix, suffix
        bos = self.tokenizer.bos_token or ""
        answered = [f"{texts[i]}\nAnswer: {texts[i + 1]}\n\n" for i in range(0, len(history), 2)]
        return f"{bos}{system}\n{INSTRUCTION}\n\n", "".join(answered) + f"{texts[-1]}\nAnswer:"


def request_layout(
    prompts: PromptBuilder, request: GenerateRequest, max_model_len: int
) -> PromptLayout:
    """The request's prompt (with `fit_context`, turns and chunks dropped until it fits,
    `fit_prompt`; then, with chunk_order best_last, the kept chunks reversed), checked by
    `fitting`. A raw prompt is taken as it is."""
    if request.raw_prompt or request.prompt_token_ids is not None:
        layout = prompts.raw(request.question, request.prompt_token_ids)
        return fitting(layout, request.max_tokens, max_model_len)
    chunks = tuple(prompts.chunk_tokens(c.text) for c in request.chunks)
    if request.fit_context:
        layout = fit_prompt(prompts, request, chunks, max_model_len - request.max_tokens)
    else:
        layout = prompts.frame(request.question, chunks, request.system, request.history)
    salts = tuple(c.cache_salt for c in request.chunks)
    if any(salts) or request.cache_salt:
        # fit_context keeps the first chunks: their salts are the first ones.
        kept = salts[: len(layout.chunks)] if any(salts) else ()
        layout = replace(layout, chunk_salts=kept, cache_salt=request.cache_salt)
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


def fit_prompt(
    prompts: PromptBuilder,
    request: GenerateRequest,
    chunks: tuple[tuple[int, ...], ...],
    max_tokens: int,
) -> PromptLayout:
    """The request's prompt with what does not fit in `max_tokens` tokens left out, in this
    order: the oldest exchanges (a user turn and its answer) but the last one, then chunks from
    the end (the worst), then the last exchange. A follow-up ("and its timeout?") needs the
    exchange before it more than the worst passage; older turns matter least. The question and
    the frame always stay, so the result may still be longer."""
    history = request.history
    exchanges = len(history) // 2

    def without(dropped: int) -> PromptLayout:  # the oldest `dropped` exchanges left out
        kept = history[2 * dropped :]
        return prompts.frame(request.question, chunks, request.system, kept, 2 * dropped)

    # Fewer turns never make a longer suffix: the fewest exchanges to drop, by bisection (a
    # rendering each), keeping the last one.
    low, high = 0, max(exchanges - 1, 0)
    while low < high:
        middle = (low + high) // 2
        if without(middle).num_tokens <= max_tokens:
            high = middle
        else:
            low = middle + 1
    layout = without(low).fitted(max_tokens)
    if layout.num_tokens <= max_tokens or exchanges == 0:
        return layout
    return without(exchanges).fitted(max_tokens)
