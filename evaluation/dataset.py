"""The evaluation dataset: JSONL, one question a line (question, passages, answers, optional
id and kind), validated with pydantic; a bad line is an error naming its number and field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

# Size limits: a LongBench context (~10-20K words) fits in one line with room to spare.
MAX_LINE_BYTES = 8 * 2**20
MAX_RECORDS = 100_000
MAX_DOCUMENTS = 1_000_000
MAX_QUESTION_CHARS = 256 * 2**10
MAX_PASSAGES = 512
MAX_PASSAGE_CHARS = 256 * 2**10
MAX_ANSWERS = 64
MAX_ANSWER_CHARS = 64 * 2**10
MAX_ID_CHARS = 256
MAX_KIND_CHARS = 64

M = TypeVar("M", bound=BaseModel)
Text = Annotated[str, StringConstraints(min_length=1, pattern=r"\S")]


class DatasetError(ValueError):
    """The dataset file cannot be used; the message names the file, line and field."""


class Record(BaseModel):
    """One question with its context and gold answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    kind: str | None = Field(None, min_length=1, max_length=MAX_KIND_CHARS)
    question: Annotated[Text, Field(max_length=MAX_QUESTION_CHARS)]
    passages: list[Annotated[Text, Field(max_length=MAX_PASSAGE_CHARS)]] = Field(
        default_factory=list, max_length=MAX_PASSAGES
    )
    answers: list[Annotated[Text, Field(max_length=MAX_ANSWER_CHARS)]] = Field(
        min_length=1, max_length=MAX_ANSWERS
    )


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "record"
    return f"{field}: {first['msg']}"


def parse_line(model: type[M], text: str, where: str) -> M:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return validate(model, data, where)


def validate(model: type[M], data: dict[str, Any], where: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise DatasetError(f"{where}: {_describe(exc)}") from None


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line, refusing lines over the size limit."""
    try:
        file = path.open("rb")
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None
    with file:
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise DatasetError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                raise DatasetError(f"{path}:{number}: not UTF-8") from None
            if text.strip():
                yield number, text


def load_dataset(
    path: Path, limit: int | None = None, require_passages: bool = True
) -> list[Record]:
    """The first `limit` records of a JSONL file, each with an id (`line-N` when the line gives
    none). `require_passages`: retrieval is off, so every record must bring its passages."""
    records: list[Record] = []
    ids: dict[str, int] = {}
    for number, text in read_lines(path):
        if limit is not None and len(records) == limit:
            break
        if len(records) == MAX_RECORDS:
            raise DatasetError(f"{path}: more than {MAX_RECORDS} records")
        where = f"{path}:{number}"
        record = parse_line(Record, text, where)
        if require_passages and not record.passages:
            raise DatasetError(f"{where}: passages: required when retrieval is off")
        record_id = record.id or f"line-{number}"
        if record_id in ids:
            raise DatasetError(
                f"{where}: id: {record_id!r} is already used on line {ids[record_id]}"
            )
        ids[record_id] = number
        records.append(record.model_copy(update={"id": record_id}))
    if not records:
        raise DatasetError(f"{path}: no records")
    return records


class Document(BaseModel):
    """One line of a retrieval corpus file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: Annotated[Text, Field(max_length=MAX_PASSAGE_CHARS)]


def load_corpus(path: Path) -> list[str]:
    """The documents of a JSONL corpus file, one {"text": ...} a line (blank lines skipped)."""
    documents: list[str] = []
    for number, text in read_lines(path):
        if len(documents) == MAX_DOCUMENTS:
            raise DatasetError(f"{path}: more than {MAX_DOCUMENTS} documents")
        documents.append(parse_line(Document, text, f"{path}:{number}").text)
    if not documents:
        raise DatasetError(f"{path}: no documents")
    return documents
