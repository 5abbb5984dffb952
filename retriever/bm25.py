"""User text to a safe FTS5 MATCH expression for BM25 search: words become quoted terms joined
by OR, so no character of a query is ever read as FTS5 syntax (`"`, `AND`, `*`, `NEAR(`...)."""

from __future__ import annotations

import re

# Bounds the work of one BM25 search: every term is one posting list to merge.
MAX_TERMS = 32
# Words that occur in most chunks: as OR terms they would make every chunk a candidate and add
# nothing to the ranking (BM25's idf is near zero for them).
_STOPWORDS_TEXT = """
a an and are as at be by for from has have he her his how in is it its of on or she that
the their them they this to was were what when where which who whom whose why will with
"""
STOPWORDS = frozenset(_STOPWORDS_TEXT.split())
_WORD = re.compile(r"\w+")


def terms(text: str) -> list[str]:
    """The distinct words of `text`, lower-cased, in order, stopwords left out (unless the text
    has nothing else), at most MAX_TERMS."""
    words = list(dict.fromkeys(w.lower() for w in _WORD.findall(text)))
    kept = [w for w in words if w not in STOPWORDS] or words
    return kept[:MAX_TERMS]


def match_expression(text: str) -> str | None:
    """An FTS5 expression matching chunks with any word of `text`; None when it has no word
    (a query of punctuation only finds nothing, it is not an error)."""
    words = terms(text)
    if not words:
        return None
    # A double-quoted FTS5 string is a literal phrase; \w+ never contains a quote to escape.
    return " OR ".join(f'"{w}"' for w in words)
