"""File to text: UTF-8 text and Markdown, HTML without markup or scripts, PDF pages; the
errors that map to 415 and 422."""

from __future__ import annotations

import pytest

from retriever.extract import ExtractionError, UnsupportedFileTypeError, extract_text


def test_text_and_markdown_are_decoded_as_utf8_without_bom():
    doc = extract_text("notes.txt", "\ufeffCafé au lait.\n\nSecond line.".encode())
    assert doc.text == "Café au lait.\n\nSecond line."
    assert doc.metadata == {"filename": "notes.txt"}
    assert extract_text("README.MD", b"# Title\n\nBody").text == "# Title\n\nBody"


def test_html_keeps_visible_text_with_blocks_as_paragraphs_and_the_title():
    html = (
        b"<html><head><title>Page T</title><style>p {color: red}</style></head><body>"
        b"<h1>Heading</h1><p>Hello <b>bold</b> world</p><script>alert('x')</script>"
        b"<ul><li>one</li><li>two</li></ul>line<br>break</body></html>"
    )
    doc = extract_text("page.html", html)
    assert doc.text == "Heading\n\nHello bold world\n\none\n\ntwo\n\nline\nbreak"
    assert doc.metadata["title"] == "Page T"


def test_pdf_text_of_every_page_is_extracted(pdf_bytes):
    doc = extract_text("paper.pdf", pdf_bytes(["First page fact.", "Second page fact."]))
    assert "First page fact." in doc.text and "Second page fact." in doc.text
    assert doc.text.index("First") < doc.text.index("Second")
    assert doc.metadata["pages"] == 2


def test_non_utf8_text_is_an_extraction_error_naming_the_file():
    with pytest.raises(ExtractionError, match=r"latin\.txt is not valid UTF-8"):
        extract_text("latin.txt", "café".encode("latin-1"))


def test_broken_pdf_is_an_extraction_error():
    with pytest.raises(ExtractionError, match="not a readable PDF"):
        extract_text("broken.pdf", b"%PDF-1.4 this is not really a pdf")


@pytest.mark.parametrize("name", ["report.docx", "image.png", "noextension"])
def test_unknown_file_type_is_rejected_naming_the_type(name):
    with pytest.raises(UnsupportedFileTypeError, match="unsupported file type"):
        extract_text(name, b"data")
