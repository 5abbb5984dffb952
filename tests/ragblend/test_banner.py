"""The banner's example question: one whose document is in the collection, else a hint to ask
about one's own documents; a bad questions file is refused with its reason."""

from __future__ import annotations

import json
import shlex

import pytest

from ragblend.banner import (
    MAX_QUESTIONS_BYTES,
    QUESTIONS_FILE,
    SampleQuestion,
    banner,
    example_question,
    read_questions,
)
from ragblend.up import SAMPLES_DIR

ASKED = SampleQuestion("Which port does the gateway use?", "gateway.md", "8000")


def _curl_body(text: str) -> dict:
    """The JSON the banner's curl command sends, as the shell would pass it."""
    line = next(part for part in text.splitlines() if part.strip().startswith("-d "))
    return json.loads(shlex.split(line.strip())[1])


def test_the_banner_suggests_a_question_whose_source_was_ingested():
    chosen = example_question([ASKED], {"gateway.md", "other.md"})
    text = banner("http://127.0.0.1:8000", chosen)
    assert _curl_body(text)["question"] == ASKED.question
    assert "the answer is in gateway.md" in text


def test_the_banner_suggests_no_question_about_documents_not_in_the_collection():
    assert example_question([ASKED], {"river.md"}) is None
    text = banner("http://127.0.0.1:8000", None)
    assert _curl_body(text)["question"] == "<a question about your documents>"
    assert ASKED.question not in text


def test_a_question_with_quotes_survives_the_shell():
    tricky = SampleQuestion("What's \"the\" gateway's port?", "gateway.md", "8000")
    assert _curl_body(banner("http://x", tricky))["question"] == tricky.question


def test_a_folder_without_a_questions_file_has_no_questions(tmp_path):
    assert read_questions(tmp_path) == []


@pytest.mark.parametrize(
    "content",
    ['{"questions": [{"question": "q"}]}', "not json", '{"other": []}', "x" * MAX_QUESTIONS_BYTES],
)
def test_a_malformed_or_oversized_questions_file_is_refused_with_its_name(tmp_path, content):
    (tmp_path / QUESTIONS_FILE).write_text(content + " ")
    with pytest.raises(ValueError, match=QUESTIONS_FILE):
        read_questions(tmp_path)


def test_every_bundled_sample_question_names_a_bundled_document_holding_its_fact():
    questions = read_questions(SAMPLES_DIR)
    assert questions
    for question in questions:
        assert question.fact in (SAMPLES_DIR / question.source).read_text()


def test_the_sample_documents_are_the_docs_pages_themselves():
    """`make run` answers from the docs as they are: each sample page is a link to docs/, never
    a copy that drifts."""
    docs = (SAMPLES_DIR.parent.parent / "docs").resolve()
    pages = sorted(SAMPLES_DIR.glob("*.md"))
    assert pages
    for page in pages:
        assert page.is_symlink() and page.resolve().parent == docs, page.name
        assert page.read_text() == (docs / page.name).read_text()


def test_the_image_build_context_keeps_every_sample_page():
    """The image copies docs/ for the sample links; .dockerignore leaves out the rest of docs/
    and must let each linked page in."""
    ignore = (SAMPLES_DIR.parent.parent / ".dockerignore").read_text().splitlines()
    for page in SAMPLES_DIR.glob("*.md"):
        assert f"!docs/{page.name}" in ignore, page.name
