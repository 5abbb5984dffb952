"""Token-based chunking: split a document into chunks of at most N tokens of the LLM
tokenizer, breaking at a paragraph or sentence end when one is near."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

# A boundary counts as "near" when it lies in the last 30 % of a full window: breaking there
# costs at most 30 % of a chunk's capacity, and keeps sentences and paragraphs whole.
NEAR_BOUNDARY_FRACTION = 0.3
SENTENCE_END_CHARS = ".!?…。！？"
CHUNK_ID_HEX_CHARS = 32


class OffsetTokenizer(Protocol):
    """The part of a Hugging Face fast tokenizer that chunking uses."""

    def __call__(self, text: str, **kwargs: object) -> object: ...


@dataclass(frozen=True)
class Chunk:
    """One chunk: `text == document[start_char:end_char]`."""

    chunk_id: str
    text: str
    start_char: int
    end_char: int
    num_tokens: int


def content_hash(text: str, hex_chars: int = CHUNK_ID_HEX_CHARS) -> str:
    """The id of a text: a truncated sha256 hex of its UTF-8 bytes (same text, same id)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:hex_chars]


def token_offsets(tokenizer: OffsetTokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans of the tokens of `text`, special tokens excluded."""
    encoding = tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        truncation=False,
        verbose=False,
    )
    offsets = encoding["offset_mapping"]  # type: ignore[index]
    # Some tokenizers emit empty spans (e.g. for a lone prefix-space token); they carry no text.
    return [(int(s), int(e)) for s, e in offsets if e > s]


def _boundary_strength(text: str, end: int, next_start: int) -> int:
    """2 if a paragraph ends between the two tokens, 1 for a sentence end, else 0."""
    gap = text[end:next_start]
    if "\n\n" in gap or "\n\r\n" in gap:
        return 2
    if "\n" in gap:
        return 1
    if gap and text[end - 1] in SENTENCE_END_CHARS:
        return 1
    return 0


def _window_end(text: str, spans: list[tuple[int, int]], start: int, max_tokens: int) -> int:
    """Index one past the last token of the chunk that begins at token `start`."""
    end = start + max_tokens
    if end >= len(spans):
        return len(spans)
    earliest = end - max(1, int(max_tokens * NEAR_BOUNDARY_FRACTION))
    best, best_strength = end, 0
    # Walk back from the full window; the first paragraph end wins, else the last sentence end.
    for k in range(end, max(earliest, start + 1) - 1, -1):
        strength = _boundary_strength(text, spans[k - 1][1], spans[k][0])
        if strength > best_strength:
            best, best_strength = k, strength
            if strength == 2:
                break
    return best


def chunk_text(
    text: str, tokenizer: OffsetTokenizer, max_tokens: int, overlap_tokens: int = 0
) -> list[Chunk]:
    """Split `text` into chunks of at most `max_tokens` tokens; each chunk is a substring.

    Returns [] for text without tokens. Raises ValueError when the overlap is not below the
    chunk size.
    """
    if not 0 <= overlap_tokens < max_tokens:
        raise ValueError(f"overlap_tokens must be in [0, {max_tokens}), got {overlap_tokens}")
    spans = token_offsets(tokenizer, text)
    chunks: list[Chunk] = []
    start = 0
    while start < len(spans):
        end = _window_end(text, spans, start, max_tokens)
        start_char, end_char = spans[start][0], spans[end - 1][1]
        piece = text[start_char:end_char]
        chunks.append(Chunk(content_hash(piece), piece, start_char, end_char, end - start))
        if end >= len(spans):
            break
        start = max(end - overlap_tokens, start + 1)
    return chunks
