"""Real-text prompts from documents that ship offline: CPython's language reference, Debian's
common licenses and ragblend's docs, chunked as the retriever chunks them, questions on top."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from retriever.chunking import OffsetTokenizer, chunk_text
from retriever.settings import RetrieverSettings

LICENSES_DIR = Path("/usr/share/common-licenses")
DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
# A document larger than this is left out: the longest shipped one (GPL-3) has 35K characters.
MAX_DOCUMENT_CHARS = 200_000
DEFAULT_CHUNK_TOKENS: int = RetrieverSettings.model_fields["chunk_tokens"].default
DEFAULT_CHUNKS_PER_PROMPT = 4
MAX_CHUNKS_PER_PROMPT = 64
# Characters of text tokenized per chunk token wanted: English BPE averages about 4, so twice
# that rarely needs a second try.
_CHARS_PER_TOKEN = 8

_UNDERLINE = re.compile(r"^\s*([=*~^-])\1{2,}\s*$")
_MARKDOWN_HEADING = re.compile(r"^#{1,4}\s+(.+?)\s*$")
# "1. Definitions." or "Section 2: Scope", not "51 Franklin Street" (an address).
_NUMBERED_SECTION = re.compile(
    r"^\s*(?:Section\s+\d+[.:]?|\d+(?:\.\d+)*\.)\s+([A-Z][^.\n]{2,60})\.?\s*$"
)


class Source(StrEnum):
    """Where documents come from. `pydoc` and `licenses` do not change with the repository, so
    figures measured on them stay comparable across commits; `docs` do."""

    PYDOC = "pydoc"  # pydoc_data.topics: the language reference's topics as plain prose
    LICENSES = "licenses"  # /usr/share/common-licenses
    DOCS = "docs"  # the repository's docs/*.md

    @property
    def description(self) -> str:
        return {
            Source.PYDOC: "Python language reference",
            Source.LICENSES: "license text",
            Source.DOCS: "ragblend documentation",
        }[self]


STABLE_SOURCES = (Source.PYDOC, Source.LICENSES)


@dataclass(frozen=True)
class Document:
    name: str  # e.g. "pydoc:compound", "licenses:GPL-3", "docs:kvstore.md"
    source: Source
    text: str


@dataclass(frozen=True)
class RealTextPrompt:
    """Consecutive chunks of one document and a question about them; `answers` (gold) for the
    few questions that have them."""

    id: str  # document name and the index of the prompt's first chunk, e.g. "pydoc:try#0"
    document: str
    question: str
    passages: tuple[str, ...]
    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class GoldQuestion:
    document: str
    question: str
    answers: tuple[str, ...]


# Each answer stands in the first chunk of its document, so a prompt made of the document's
# first chunks holds it whatever the chunk size.
GOLD_QUESTIONS = (
    GoldQuestion(
        "licenses:Apache-2.0",
        "When was version 2.0 of the Apache License published?",
        ("January 2004",),
    ),
    GoldQuestion(
        "licenses:GPL-3",
        "On what date was version 3 of the GNU General Public License released?",
        ("29 June 2007",),
    ),
    GoldQuestion(
        "pydoc:try",
        'Which clause of the "try" statement specifies an exception handler?',
        ("except",),
    ),
    GoldQuestion(
        "pydoc:debugger",
        "Which module defines the interactive source code debugger for Python programs?",
        ("pdb",),
    ),
)


def _readable(path: Path) -> str | None:
    """The file's text, or None when it is no regular UTF-8 file or is too large."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_DOCUMENT_CHARS:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def load_documents(sources: Iterable[Source] = tuple(Source)) -> list[Document]:
    """Every available document of each source, sorted by name within a source; a source that
    is absent on this machine (no /usr/share/common-licenses) gives none."""
    documents: list[Document] = []
    for source in dict.fromkeys(sources):
        if source is Source.PYDOC:
            from pydoc_data.topics import topics

            found = [
                Document(f"pydoc:{name}", source, text)
                for name, text in sorted(topics.items())
                if len(text) <= MAX_DOCUMENT_CHARS
            ]
        else:
            folder, pattern = (
                (LICENSES_DIR, "*") if source is Source.LICENSES else (DOCS_DIR, "*.md")
            )
            found = []
            for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
                text = _readable(path)
                if text is not None and text.strip():
                    found.append(Document(f"{source.value}:{path.name}", source, text))
        documents.extend(found)
    return documents


def headings(text: str) -> list[str]:
    """Section titles in reading order: reST-underlined lines, Markdown headings and numbered
    sections ("1. Definitions.")."""
    lines = text.splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        title = line.strip()
        markdown = _MARKDOWN_HEADING.match(title)
        numbered = _NUMBERED_SECTION.match(line)
        if markdown:
            found.append(markdown.group(1))
        elif title and i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1]):
            if not _UNDERLINE.match(line):
                found.append(title)
        elif numbered:
            found.append(numbered.group(1).strip())
    cleaned = (h.replace("`", "").strip("*\"' ") for h in found)
    return [h for h in cleaned if h]


def question_for(document: Document, passages: Sequence[str]) -> str:
    """A question on the first passage's section: its answer lies chunks away from the
    question, so the blend must carry what the later chunks read from the earlier ones."""
    name = document.name.split(":", 1)[1]
    titled = headings(passages[0])
    if titled:
        return (
            f"What does the {document.source.description} above say in the section “{titled[0]}”?"
        )
    return f"Summarize what the {document.source.description} above ({name}) says."


def leading_chunks(
    text: str, tokenizer: OffsetTokenizer, chunk_tokens: int, count: int
) -> list[str]:
    """The first `count` chunks of chunk_text(text) (all of them when there are fewer),
    tokenizing only a prefix of the text long enough for them: a long document costs what its
    first chunks cost. The prefix keeps one whole chunk beyond those returned, so tokens cut at
    its end never reach them."""
    chars = (count + 2) * chunk_tokens * _CHARS_PER_TOKEN
    while chars < len(text):
        chunks = chunk_text(text[:chars], tokenizer, chunk_tokens)
        if len(chunks) > count + 1:
            return [c.text for c in chunks[:count]]
        chars *= 2
    return [c.text for c in chunk_text(text, tokenizer, chunk_tokens)[:count]]


def _window(
    document: Document,
    tokenizer: OffsetTokenizer,
    chunk_tokens: int,
    chunks_per_prompt: int,
    index: int,
) -> tuple[str, ...] | None:
    """The `index`-th run of `chunks_per_prompt` consecutive chunks, None past the last."""
    end = (index + 1) * chunks_per_prompt
    chunks = leading_chunks(document.text, tokenizer, chunk_tokens, end)
    return tuple(chunks[end - chunks_per_prompt :]) if len(chunks) == end else None


def _check(chunk_tokens: int, chunks_per_prompt: int) -> None:
    if not 8 <= chunk_tokens <= 32768:
        raise ValueError(f"chunk_tokens must be in 8..32768, got {chunk_tokens}")
    if not 1 <= chunks_per_prompt <= MAX_CHUNKS_PER_PROMPT:
        raise ValueError(
            f"chunks_per_prompt must be in 1..{MAX_CHUNKS_PER_PROMPT}, got {chunks_per_prompt}"
        )


def build_prompts(
    tokenizer: OffsetTokenizer,
    *,
    sources: Iterable[Source] = STABLE_SOURCES,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunks_per_prompt: int = DEFAULT_CHUNKS_PER_PROMPT,
    limit: int | None = None,
) -> list[RealTextPrompt]:
    """Prompts of `chunks_per_prompt` consecutive chunks (the retriever's chunking with the
    LLM's tokenizer), documents too short for one left out. Ordered so that any first N mix the
    sources and documents: every document's first window, sources taken in turn, then every
    document's second window, and so on. Raises ValueError for sizes out of range."""
    _check(chunk_tokens, chunks_per_prompt)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    by_source: dict[Source, list[Document]] = {}
    for document in load_documents(sources):
        by_source.setdefault(document.source, []).append(document)
    interleaved = [
        d for group in itertools.zip_longest(*by_source.values()) for d in group if d is not None
    ]
    prompts: list[RealTextPrompt] = []
    for index in itertools.count():
        still = []
        for document in interleaved:
            passages = _window(document, tokenizer, chunk_tokens, chunks_per_prompt, index)
            if passages is None:
                continue
            still.append(document)
            prompts.append(
                RealTextPrompt(
                    f"{document.name}#{index * chunks_per_prompt}",
                    document.name,
                    question_for(document, passages),
                    passages,
                )
            )
            if limit is not None and len(prompts) >= limit:
                return prompts
        if not still:
            return prompts
        interleaved = still
    raise AssertionError("unreachable: itertools.count() never ends")


def gold_prompts(
    tokenizer: OffsetTokenizer,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunks_per_prompt: int = DEFAULT_CHUNKS_PER_PROMPT,
) -> list[RealTextPrompt]:
    """The questions with gold answers, each over the first chunks of its document (fewer than
    `chunks_per_prompt` when the document is shorter); those whose document is absent on this
    machine are left out."""
    _check(chunk_tokens, chunks_per_prompt)
    names = {gold.document for gold in GOLD_QUESTIONS}
    documents = {d.name: d for d in load_documents(STABLE_SOURCES) if d.name in names}
    prompts = []
    for gold in GOLD_QUESTIONS:
        document = documents.get(gold.document)
        if document is None:
            continue
        chunks = leading_chunks(document.text, tokenizer, chunk_tokens, chunks_per_prompt)
        prompts.append(
            RealTextPrompt(
                f"{gold.document}#gold",
                gold.document,
                gold.question,
                tuple(chunks),
                gold.answers,
            )
        )
    return prompts
