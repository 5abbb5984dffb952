"""The second retrieval hop: the names that the first hop's chunks mention and the question
does not (a bridge entity: "the city of Braigi? It is Houstom.") seed further searches."""

from __future__ import annotations

import re
from collections.abc import Sequence

# At most this many entities seed searches, whatever top_k is: each one is a search.
MAX_HOP_ENTITIES = 8
MAX_QUESTION_NAMES = 16
# A word: letters first, then letters, digits, apostrophes or hyphens ("O'Neil", "Saint-Malo").
_WORD = re.compile(r"[^\W\d_][\w'-]*")
# Between a sentence's end and its first word: spaces, quotes, brackets.
_OPENERS = " \t\"'([\u201c\u2018"
_SENTENCE_ENDS = (".", "!", "?", ":", "\n")


def _starts_sentence(text: str, start: int) -> bool:
    """Whether the word at `start` opens the text, a line or a sentence (only a few characters
    before it are looked at, so the check costs the same anywhere in a long chunk)."""
    before = text[max(0, start - 16) : start].rstrip(_OPENERS)
    return not before or before.endswith(_SENTENCE_ENDS)


def entities(question: str, texts: Sequence[str], limit: int = MAX_HOP_ENTITIES) -> list[str]:
    """Names in `texts`, in order of first appearance (texts taken in the order given, best
    first), that the question does not already name; at most `limit`.

    A name is a run of capitalised words separated by spaces ("Ada Lindqvist"); a one-letter
    word ("I", "A") is not a name. A sentence's first word is capitalised anyway, so it never
    counts ("The Selvik mill" gives "Selvik", "It is Houstom." gives "Houstom"); nor does a
    word the question contains, compared without case.
    """
    asked = {w.lower() for w in _WORD.findall(question)}
    found: dict[str, None] = {}
    for text in texts:
        run: list[str] = []
        run_end = -1
        for match in _WORD.finditer(text):
            word = match.group()
            is_name = (
                len(word) > 1
                and word[0].isupper()
                and word.lower() not in asked
                and not _starts_sentence(text, match.start())
            )
            joins = is_name and run and text[run_end : match.start()].strip(" \t") == ""
            if run and not joins:
                found.setdefault(" ".join(run))
                run = []
            if is_name:
                run.append(word)
                run_end = match.end()
        if run:
            found.setdefault(" ".join(run))
        if len(found) >= limit:
            break
    return list(found)[:limit]


def second_hop_query(question: str, entity: str) -> str:
    """The query of one second-hop search: the question with the names it contains replaced
    by the entity ("What is the river of the city of Braigi?" with "Houstom" gives "... of the
    city of Houstom?"), so that it asks about the entity; appended when the question names
    nobody. (Replacing rather than appending matters for dense search, whose one vector would
    otherwise stay close to the first question's.)"""
    names = entities("", [question], MAX_QUESTION_NAMES)
    if not names:
        return f"{question} {entity}"
    pattern = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.sub(rf"\b(?:{pattern})\b", lambda _: entity, question)
