"""scripts/convert_dataset.py: LongBench lines of the paper's four datasets (hand-made fixture
lines in LongBench's shape) and the demo corpus's held-out questions become valid eval JSONL."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from evaluation.dataset import load_dataset

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "longbench_sample.jsonl"


@pytest.fixture(scope="module")
def convert():
    spec = importlib.util.spec_from_file_location(
        "convert_dataset", REPO_ROOT / "scripts" / "convert_dataset.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_longbench_lines_become_records_cut_per_dataset(convert, tmp_path):
    out = tmp_path / "out.jsonl"
    assert convert.main(["longbench", str(FIXTURE), "--window-words", "5", "-o", str(out)]) == 0
    records = {r.id: r for r in load_dataset(out)}
    assert list(records) == ["wiki-0001", "musique-0001", "samsum-0001", "news-0001", "news-0002"]

    wiki = records["wiki-0001"]  # one passage per "Passage N:" marker, the marker dropped
    assert wiki.kind == "2wikimqa"
    assert wiki.question == "Who was born first, Arvo Lind or Mira Sova?"
    assert wiki.answers == ["Arvo Lind"]
    # passages of 12, 10 and 12 words, each cut into windows of 5 words
    assert len(wiki.passages) == 3 + 2 + 3
    assert wiki.passages[:3] == [
        "Arvo Lind Arvo Lind (born",
        "3 May 1931) was an",
        "Estonian sculptor.",
    ]
    musique = records["musique-0001"]
    assert musique.passages == [
        "Tarn bridge The Tarn bridge",
        "was built in Ostrava.",
        "Ostrava Ostrava lies on the",
        "Oder river.",
    ]
    assert musique.answers == ["Oder", "the Oder river"]


def test_qa_passages_keep_their_text_when_short_enough(convert, tmp_path):
    out = tmp_path / "out.jsonl"
    assert convert.main(["longbench", str(FIXTURE), "-o", str(out)]) == 0
    records = {r.id: r for r in load_dataset(out)}
    assert records["wiki-0001"].passages == [
        "Arvo Lind\nArvo Lind (born 3 May 1931) was an Estonian sculptor.",
        "Kelmora River\nThe Kelmora is a river in the north.",
        "Mira Sova\nMira Sova (born 9 June 1944) is a Slovene poet.",
    ]
    samsum = records["samsum-0001"]  # each few-shot example is one passage
    assert samsum.kind == "samsum"
    assert samsum.passages == [
        "Dialogue: Cai: Did you feed the cat?\nDee: Yes, twice.\nSummary: Dee fed the cat twice.",
        "Dialogue: Eve: Movie tonight?\nFin: Can't, working late.\n"
        "Summary: Fin works late and skips the movie.",
    ]
    assert samsum.question.startswith(convert.SAMSUM_INSTRUCTION)
    assert samsum.question.endswith("Ben: Sure, the usual place.\nSummary:")
    news = records["news-0001"]  # documents at their markers; no input: the instruction
    assert news.kind == "multi_news"
    assert news.question == convert.MULTI_NEWS_INSTRUCTION
    assert len(news.passages) == 2 and news.passages[1].startswith("Residents welcomed")
    # no markers (LongBench-E name): one document, whole while under the window
    assert records["news-0002"].passages == [
        "one two three four five six seven eight nine ten eleven twelve"
    ]


def test_unmarked_news_is_cut_at_the_original_separator_or_into_windows(convert):
    line = convert.LongBenchLine(context="First story. ||||| Second story.", answers=["s"])
    assert convert.convert_line(line, "multi_news", "x:1", 384).passages == [
        "First story.",
        "Second story.",
    ]
    line = convert.LongBenchLine(context="a1 a2 a3 a4 a5 a6 a7", answers=["s"])
    assert convert.convert_line(line, "multi_news", "x:1", 3).passages == [
        "a1 a2 a3",
        "a4 a5 a6",
        "a7",
    ]


@pytest.mark.parametrize(
    ("line", "args", "message"),
    [
        ({"context": "Passage 1:\nx", "answers": ["a"]}, [], "x.jsonl:1: dataset: missing"),
        ({"context": "x", "answers": ["a"], "dataset": "trec"}, [], "unknown dataset 'trec'"),
        ({"context": "x", "answers": []}, ["--dataset", "musique"], "x.jsonl:1: answers: List"),
        ({"context": " ", "answers": ["a"]}, ["--dataset", "musique"], "context: no passages"),
        ({"input": "q", "answers": ["a"]}, ["--dataset", "musique"], "context: Field required"),
    ],
)
def test_a_bad_longbench_line_is_an_error_naming_it(convert, tmp_path, capsys, line, args, message):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert convert.main(["longbench", str(path), *args, "-o", str(tmp_path / "o.jsonl")]) == 2
    assert message in capsys.readouterr().err


def test_demo_questions_are_exported_seeded_with_their_kinds(convert, tmp_path):
    first, again, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert convert.main(["demo", "--count", "6", "--seed", "7", "-o", str(first)]) == 0
    assert convert.main(["demo", "--count", "6", "--seed", "7", "-o", str(again)]) == 0
    assert convert.main(["demo", "--count", "6", "--seed", "8", "-o", str(other)]) == 0
    assert first.read_text() == again.read_text() != other.read_text()
    records = load_dataset(first)
    assert [r.kind for r in records] == ["single", "multi", "context"] * 2
    assert all(len(r.answers) == 1 and r.answers[0] in " ".join(r.passages) for r in records)
    assert records[0].id == "demo-7-0"
