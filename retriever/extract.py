"""File to text: plain text and Markdown as UTF-8, HTML through BeautifulSoup, PDF through
pypdf; each result carries the metadata the file itself tells."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

SUPPORTED_SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf")
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


def pdf_to_text(data: bytes, filename: str) -> tuple[str, dict[str, Any]]:
    """Text of every page, pages separated by a blank line."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise ExtractionError(f"{filename} is an encrypted PDF")
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as exc:
        if isinstance(exc, ExtractionError):
            raise
        raise ExtractionError(f"{filename} is not a readable PDF: {exc}") from exc
    text = "\n\n".join(_normalise_whitespace(page) for page in pages)
    return text.strip(), {"pages": len(pages)}


def extract_text(filename: str, data: bytes) -> ExtractedDocument:
    """Text and metadata of one file, chosen by its suffix.

    Raises UnsupportedFileTypeError for a suffix not in SUPPORTED_SUFFIXES and
    ExtractionError when the content does not decode.
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
        text, extra = pdf_to_text(data, name)
    elif suffix in (".html", ".htm"):
        text, extra = html_to_text(_decode_utf8(data, name))
    else:
        text, extra = _decode_utf8(data, name), {}
    metadata.update(extra)
    return ExtractedDocument(text=text, metadata=metadata)
