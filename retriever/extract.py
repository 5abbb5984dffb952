"""File to text: plain text and Markdown as UTF-8, HTML through BeautifulSoup, PDF through
pypdf; each result carries the metadata the file itself tells."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from retriever.settings import DEFAULT_MAX_DOCUMENT_CHARS

SUPPORTED_SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf")
# An HTML page may carry this many characters of markup per character of text it is allowed.
HTML_MARKUP_FACTOR = 4
# Tags whose text is never content a reader sees.
_INVISIBLE_TAGS = ("script", "style", "noscript", "template", "head")
# Block-level tags end a paragraph, so that chunking can break between them.
_BLOCK_TAGS = (
    "p",
    "div",
    "section",
    "article",
    "header",
    "footer",
    "aside",
    "nav",
    "main",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "li",
    "ul",
    "ol",
    "dl",
    "dt",
    "dd",
    "table",
    "tr",
    "pre",
    "blockquote",
    "figure",
    "figcaption",
    "hr",
    "form",
)


class ExtractionError(ValueError):
    """The file's content could not be turned into text (bad encoding, broken PDF, ...)."""


class ExtractionLimitError(ValueError):
    """The file holds (or expands to) more text than max_document_chars, or a PDF stream
    decompresses past pypdf's limits."""


class UnsupportedFileTypeError(ValueError):
    """The file's type is not one the retriever reads."""


@dataclass(frozen=True)
class ExtractedDocument:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def is_supported(filename: str) -> bool:
    return PurePath(filename).suffix.lower() in SUPPORTED_SUFFIXES


def _decode_utf8(data: bytes, filename: str) -> str:
    try:
        # utf-8-sig drops a byte-order mark that editors on Windows like to write.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ExtractionError(
            f"{filename} is not valid UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r})"
        ) from exc


def _normalise_whitespace(text: str) -> str:
    lines = [re.sub(r"[ \t\r\f\v\u00a0]+", " ", line).strip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def html_to_text(html: str) -> tuple[str, dict[str, Any]]:
    """Visible text of an HTML page with one blank line between blocks, and its title."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    title = soup.title.get_text(strip=True) if soup.title else None
    for tag in soup(_INVISIBLE_TAGS):
        tag.decompose()
    for br in soup.find_all("br"):
        br.replace_with("\n")
    for block in soup.find_all(_BLOCK_TAGS):
        block.insert_before("\n\n")
        block.insert_after("\n\n")
    metadata = {"title": title} if title else {}
    return _normalise_whitespace(soup.get_text()), metadata


def _too_long(filename: str, max_chars: int) -> ExtractionLimitError:
    return ExtractionLimitError(
        f"{filename} holds more than max_document_chars ({max_chars}) characters of text"
    )


def pdf_to_text(data: bytes, filename: str, max_chars: int) -> tuple[str, dict[str, Any]]:
    """Text of every page, pages separated by a blank line; stops with ExtractionLimitError
    as soon as the text passes `max_chars`."""
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError

    pages: list[str] = []
    num_chars = 0
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise ExtractionError(f"{filename} is an encrypted PDF")
        for page in reader.pages:
            pages.append(_normalise_whitespace(page.extract_text() or ""))
            num_chars += len(pages[-1]) + 2
            if num_chars > max_chars:
                raise _too_long(filename, max_chars)
    except (ExtractionError, ExtractionLimitError):
        raise
    except LimitReachedError as exc:
        raise ExtractionLimitError(f"{filename} expands past a PDF size limit: {exc}") from exc
    # A malformed PDF makes pypdf raise almost anything (KeyError, IndexError, RecursionError,
    # zlib.error, ...): whatever it raises, the file is unreadable, never a server error.
    except Exception as exc:
        raise ExtractionError(f"{filename} is not a readable PDF: {exc}") from exc
    return "\n\n".join(pages).strip(), {"pages": len(pages)}


def extract_text(
    filename: str, data: bytes, max_chars: int = DEFAULT_MAX_DOCUMENT_CHARS
) -> ExtractedDocument:
    """Text and metadata of one file, chosen by its suffix.

    Raises UnsupportedFileTypeError for a suffix not in SUPPORTED_SUFFIXES, ExtractionError
    when the content does not decode, and ExtractionLimitError when it holds more than
    `max_chars` characters of text (HTML: of markup, at most HTML_MARKUP_FACTOR times that).
    """
    name = PurePath(filename).name
    suffix = PurePath(filename).suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise UnsupportedFileTypeError(
            f"unsupported file type {suffix or '(none)'!r} for {name}; "
            f"supported: {', '.join(SUPPORTED_SUFFIXES)}"
        )
    metadata: dict[str, Any] = {"filename": name}
    if suffix == ".pdf":
        text, extra = pdf_to_text(data, name, max_chars)
    elif suffix in (".html", ".htm"):
        html = _decode_utf8(data, name)
        # Parsing costs time and memory by the markup's size, so it is bounded before parsing.
        if len(html) > HTML_MARKUP_FACTOR * max_chars:
            raise _too_long(name, max_chars)
        text, extra = html_to_text(html)
    else:
        text, extra = _decode_utf8(data, name), {}
    if len(text) > max_chars:
        raise _too_long(name, max_chars)
    metadata.update(extra)
    return ExtractedDocument(text=text, metadata=metadata)
