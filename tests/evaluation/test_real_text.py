"""The real-text prompt set: consecutive chunks of shipped documents cut by the retriever's
chunking with SmolLM2's tokenizer, sources mixed, gold answers inside their passages."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from evaluation.real_text import (
    GOLD_QUESTIONS,
    Source,
    build_prompts,
    gold_prompts,
    headings,
    leading_chunks,
    load_documents,
)
from retriever.chunking import chunk_text
from tests import real_model

smollm2_dir = real_model.smollm2_dir
CHUNK_TOKENS = 256


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return build_prompts(tokenizer, chunk_tokens=CHUNK_TOKENS, chunks_per_prompt=4, limit=40)


def test_prompts_are_runs_of_consecutive_chunks_of_one_document(prompts, tokenizer):
    texts = {d.name: d.text for d in load_documents()}
    assert len(prompts) == 40
    for prompt in prompts:
        assert len(prompt.passages) == 4
        text, cursor = texts[prompt.document], None
        for passage in prompt.passages:
            assert len(tokenizer(passage, add_special_tokens=False)["input_ids"]) <= CHUNK_TOKENS
            start = text.index(passage, cursor or 0)
            if cursor is not None:
                # Only the whitespace the chunker breaks at lies between two chunks.
                assert text[cursor:start].strip() == ""
            cursor = start + len(passage)


def test_leading_chunks_are_the_documents_first_chunks(tokenizer):
    texts = {d.name: d.text for d in load_documents()}
    for name in ("pydoc:specialnames", "licenses:GPL-3", "pydoc:try"):
        whole = [c.text for c in chunk_text(texts[name], tokenizer, 64)]
        for count in (1, 5, len(whole), len(whole) + 3):
            assert leading_chunks(texts[name], tokenizer, 64, count) == whole[:count]


def test_the_first_prompts_mix_documents_and_sources(prompts):
    first = prompts[:10]
    assert len({p.document for p in first}) == 10
    assert {p.document.split(":")[0] for p in first} == {"pydoc", "licenses"}
    assert len({p.id for p in prompts}) == len(prompts)


def test_prompts_are_the_same_on_every_build(prompts, tokenizer):
    again = build_prompts(tokenizer, chunk_tokens=CHUNK_TOKENS, chunks_per_prompt=4, limit=40)
    assert again == prompts


def test_a_question_names_the_section_its_first_chunk_opens():
    assert headings('The "try" statement\n*******************\n\nText.') == ['The "try" statement']
    assert headings("# Engine\n\n## The blend\n") == ["Engine", "The blend"]
    assert headings('   1. Definitions.\n\n      "License" shall mean') == ["Definitions"]
    # A street address is no section.
    assert headings("    51 Franklin Street, Fifth Floor, Boston, MA\n") == []


def test_gold_answers_stand_in_their_passages(tokenizer):
    found = gold_prompts(tokenizer, chunk_tokens=CHUNK_TOKENS)
    assert [p.document for p in found] == [g.document for g in GOLD_QUESTIONS]
    for prompt in found:
        assert prompt.answers and any(a in "".join(prompt.passages) for a in prompt.answers)


def test_docs_are_a_source_of_their_own(tokenizer):
    docs = build_prompts(tokenizer, sources=[Source.DOCS], chunk_tokens=512, limit=3)
    assert docs and all(p.document.startswith("docs:") for p in docs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chunk_tokens": 4}, "chunk_tokens"),
        ({"chunks_per_prompt": 0}, "chunks_per_prompt"),
        ({"chunks_per_prompt": 65}, "chunks_per_prompt"),
        ({"limit": 0}, "limit"),
    ],
)
def test_sizes_out_of_range_are_refused(tokenizer, options, message):
    with pytest.raises(ValueError, match=message):
        build_prompts(tokenizer, **options)
