"""Converts datasets to the JSONL of `ragblend eval` (docs/eval.md): the CacheBlend paper's
LongBench sets (2WikiMQA, MuSiQue, SAMSum, MultiNews) and the demo corpus's held-out questions.

    .venv/bin/python scripts/convert_dataset.py longbench 2wikimqa.jsonl -o 2wikimqa-eval.jsonl
    .venv/bin/python scripts/convert_dataset.py demo -o demo-eval.jsonl --count 60

LongBench lines carry input, context, answers, dataset and _id. Passages are cut from the context:
2WikiMQA and MuSiQue at their "Passage N:" markers (one passage each); SAMSum at each few-shot
example ("Dialogue: ... Summary: ..."); MultiNews at "Passage N:"/"Document N:" markers or the
"|||||" separator of the original Multi-News, else into windows of --window-words words. Any
passage longer than --window-words words is cut into such windows too.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from evaluation.dataset import DatasetError, Record, parse_line, read_lines, validate

# The demo's held-out test seed: questions never used to choose a training run.
DEMO_TEST_SEED = 2_000_003

_MARKER = re.compile(r"(?m)^[ \t]*(?:Passage|Document) \d+:[ \t]*\n?")
_DIALOGUE = re.compile(r"(?m)^(?=Dialogue:)")
SAMSUM_INSTRUCTION = "Summarize the dialogue into a few short sentences, like the examples."
MULTI_NEWS_INSTRUCTION = "Write a one-page summary of all the news passages."


class LongBenchLine(BaseModel):
    """The fields of a LongBench line that the conversion reads."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    input: str = ""
    context: str
    answers: list[str] = Field(min_length=1)
    dataset: str | None = None
    id: str | None = Field(None, alias="_id")


def windows(text: str, size: int) -> list[str]:
    """`text` whole when it has at most `size` words, else in pieces of `size` words (joined by
    single spaces: its line breaks are lost)."""
    words = text.split()
    if len(words) <= size:
        return [text]
    return [" ".join(words[i : i + size]) for i in range(0, len(words), size)]


def at_markers(context: str) -> list[str]:
    return [p.strip() for p in _MARKER.split(context) if p.strip()]


def at_dialogues(context: str) -> list[str]:
    return [p.strip() for p in _DIALOGUE.split(context) if p.strip()]


def news_documents(context: str) -> list[str]:
    if _MARKER.search(context):
        return at_markers(context)
    if "|||||" in context:
        return [p.strip() for p in context.split("|||||") if p.strip()]
    return [context.strip()]  # cut into windows by convert_line


# dataset -> (how its context becomes passages, how its input becomes the question)
SPLITTERS: dict[str, tuple[Callable[[str], list[str]], Callable[[str], str]]] = {
    "2wikimqa": (at_markers, str.strip),
    "musique": (at_markers, str.strip),
    "samsum": (at_dialogues, lambda text: f"{SAMSUM_INSTRUCTION}\n\n{text.strip()}"),
    "multi_news": (news_documents, lambda text: text.strip() or MULTI_NEWS_INSTRUCTION),
}


def dataset_name(name: str) -> str:
    """LongBench's name of a set, its LongBench-E variant (suffix _e) included."""
    base = name.lower().removesuffix("_e")
    if base not in SPLITTERS:
        raise DatasetError(f"unknown dataset {name!r}; expected one of {', '.join(SPLITTERS)}")
    return base


def convert_line(line: LongBenchLine, dataset: str, where: str, window_words: int) -> Record:
    split, question = SPLITTERS[dataset]
    passages = [piece for p in split(line.context) for piece in windows(p, window_words)]
    if not passages:
        raise DatasetError(f"{where}: context: no passages")
    record = {
        "id": line.id or f"{dataset}-{where.rsplit(':', 1)[-1]}",
        "kind": dataset,
        "question": question(line.input),
        "passages": passages,
        "answers": line.answers,
    }
    return validate(Record, record, where)


def convert_longbench(
    path: Path, dataset: str | None, window_words: int, limit: int | None
) -> Iterator[Record]:
    for count, (number, text) in enumerate(read_lines(path)):
        if limit is not None and count == limit:
            return
        where = f"{path}:{number}"
        line = parse_line(LongBenchLine, text, where)
        name = dataset or line.dataset
        if name is None:
            raise DatasetError(f"{where}: dataset: missing (or pass --dataset)")
        yield convert_line(line, dataset_name(name), where, window_words)


def demo_records(count: int, seed: int) -> Iterator[Record]:
    from demo.corpus import held_out

    for i, example in enumerate(held_out(count, seed)):
        yield Record(
            id=f"demo-{seed}-{i}",
            kind=example.kind,
            question=example.question,
            passages=list(example.passages),
            answers=[example.answer],
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="source", required=True)
    longbench = commands.add_parser("longbench", help="LongBench JSONL (the paper's datasets)")
    longbench.add_argument("inputs", nargs="+", type=Path, help="LongBench .jsonl files")
    longbench.add_argument(
        "--dataset", help="2wikimqa, musique, samsum or multi_news (default: each line's field)"
    )
    longbench.add_argument("--window-words", type=int, default=384, help="longest passage")
    longbench.add_argument("--limit", type=int, help="first N lines of each file")
    demo = commands.add_parser("demo", help="the demo corpus's held-out questions")
    demo.add_argument("--count", type=int, default=60, help="questions (thirds of each kind)")
    demo.add_argument("--seed", type=int, default=DEMO_TEST_SEED, help="held-out seed")
    for command in (longbench, demo):
        command.add_argument("-o", "--output", type=Path, required=True, help="JSONL to write")
    args = parser.parse_args(argv)

    try:
        if args.source == "demo":
            records = list(demo_records(args.count, args.seed))
        else:
            if args.window_words < 1:
                parser.error("--window-words must be at least 1")
            records = [
                record
                for path in args.inputs
                for record in convert_longbench(path, args.dataset, args.window_words, args.limit)
            ]
    except DatasetError as exc:
        print(f"convert_dataset: error: {exc}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as file:
        for record in records:
            file.write(record.model_dump_json(exclude_none=True) + "\n")
    passages = sum(len(r.passages) for r in records)
    print(f"wrote {len(records)} records ({passages} passages) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
