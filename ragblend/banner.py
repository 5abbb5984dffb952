"""What `ragblend up` prints once ready: an example question about a document actually in the
collection (from the sample folder's questions.json), else a hint to ask about one's own."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

QUESTIONS_FILE = "questions.json"
MAX_QUESTIONS_BYTES = 64 * 1024


@dataclass(frozen=True)
class SampleQuestion:
    """A question `source` (a file name in the folder) answers; the answer names `fact`."""

    question: str
    source: str
    fact: str


def read_questions(folder: Path) -> list[SampleQuestion]:
    """The folder's sample questions, none without a questions file.

    Raises ValueError for a file over MAX_QUESTIONS_BYTES or not of the form
    {"questions": [{"question", "source", "fact"}, ...]}.
    """
    path = folder / QUESTIONS_FILE
    if not path.is_file():
        return []
    if path.stat().st_size > MAX_QUESTIONS_BYTES:
        raise ValueError(f"{path}: larger than {MAX_QUESTIONS_BYTES} bytes")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["questions"]
        return [SampleQuestion(e["question"], e["source"], e["fact"]) for e in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f'{path}: expected {{"questions": [{{"question", "source", "fact"}}]}} '
            f"({exc.__class__.__name__}: {exc})"
        ) from None


def example_question(
    questions: list[SampleQuestion], ingested_sources: set[str]
) -> SampleQuestion | None:
    """The first question whose source document is in the collection."""
    return next((q for q in questions if q.source in ingested_sources), None)


def banner(gateway_url: str, question: SampleQuestion | None) -> str:
    asked = question.question if question else "<a question about your documents>"
    body = json.dumps({"question": asked, "top_k": 3})
    lines = [
        f"\nragblend is up: gateway {gateway_url} (Ctrl-C stops every service)",
        f"Try (the answer is in {question.source}):"
        if question
        else "Add documents (ragblend ingest FILE, or POST /v1/documents), then ask:",
        f"  curl -s {gateway_url}/v1/query -H 'Content-Type: application/json' \\",
        f"    -d {shlex.quote(body)}",
    ]
    return "\n".join(lines) + "\n"
