"""The JSONL dataset: valid lines load with ids, and every bad line is refused with an error
that names the file, the line number and the field."""

from __future__ import annotations

import json

import pytest

from evaluation.dataset import (
    MAX_LINE_BYTES,
    MAX_PASSAGES,
    DatasetError,
    load_corpus,
    load_dataset,
)

GOOD = {
    "question": "What is the river?",
    "passages": ["The river is Kelmora."],
    "answers": ["Kelmora"],
}


def write(tmp_path, *lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_loads_records_skipping_blank_lines_and_naming_unnamed_ones_by_line(tmp_path):
    path = write(tmp_path, GOOD, "", {**GOOD, "id": "q7", "kind": "single"}, GOOD)
    records = load_dataset(path)
    assert [r.id for r in records] == ["line-1", "q7", "line-4"]
    assert records[1].kind == "single" and records[0].kind is None
    assert records[0].answers == ["Kelmora"]
    assert [r.id for r in load_dataset(path, limit=2)] == ["line-1", "q7"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"data.jsonl:2: not valid JSON"),
        ("[1, 2]", r"data.jsonl:2: expected a JSON object, got list"),
        ({"question": "Q?", "passages": ["p"]}, r"data.jsonl:2: answers: Field required"),
        ({**GOOD, "answers": []}, r"data.jsonl:2: answers: List should have at least 1 item"),
        ({**GOOD, "answers": ["ok", " "]}, r"data.jsonl:2: answers.1: String should match"),
        ({**GOOD, "question": ""}, r"data.jsonl:2: question: String should have at least 1"),
        (
            {**GOOD, "passages": "one string"},
            r"data.jsonl:2: passages: Input should be a valid list",
        ),
        ({**GOOD, "passage": ["typo"]}, r"data.jsonl:2: passage: Extra inputs are not permitted"),
        ({**GOOD, "passages": ["p"] * (MAX_PASSAGES + 1)}, r"data.jsonl:2: passages: List should"),
        ({**GOOD, "kind": 3}, r"data.jsonl:2: kind: Input should be a valid string"),
        ({**GOOD, "id": "line-1"}, r"data.jsonl:2: id: 'line-1' is already used on line 1"),
        ({**GOOD, "passages": []}, r"data.jsonl:2: passages: required when retrieval is off"),
    ],
)
def test_a_bad_line_is_refused_naming_its_number_and_field(tmp_path, line, message):
    path = write(tmp_path, GOOD, line)
    with pytest.raises(DatasetError, match=message):
        load_dataset(path)


def test_passages_may_be_left_out_when_retrieval_is_on(tmp_path):
    path = write(tmp_path, {"question": "Q?", "answers": ["A"]})
    assert load_dataset(path, require_passages=False)[0].passages == []


def test_a_line_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\n")
    with pytest.raises(DatasetError, match=rf"big.jsonl:2: line longer than {MAX_LINE_BYTES}"):
        load_dataset(path)


def test_an_empty_or_missing_or_non_utf8_file_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="no records"):
        load_dataset(write(tmp_path, ""))
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(tmp_path / "absent.jsonl")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "caf\xe9?"}\n')
    with pytest.raises(DatasetError, match="latin1.jsonl:1: not UTF-8"):
        load_dataset(path)


def test_a_corpus_is_one_text_document_a_line(tmp_path):
    path = write(tmp_path, {"text": "first"}, {"text": "second"}, name="corpus.jsonl")
    assert load_corpus(path) == ["first", "second"]
    bad = write(tmp_path, {"text": "ok"}, {"body": "x"}, name="bad.jsonl")
    with pytest.raises(DatasetError, match="bad.jsonl:2: text: Field required"):
        load_corpus(bad)
