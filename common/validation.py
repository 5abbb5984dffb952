"""Field types that every service's request bodies share: text that can be encoded (no lone
surrogates), finite numbers, seeds that fit 64 bits, and safe document and collection ids."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

# Ids travel in URL paths and file names: letters, digits and ._:@+- in '/'-separated
# segments, none of them '.' or '..' (a path that could climb out of the documents' routes).
_ID_SEGMENT = r"[A-Za-z0-9_:@+-][A-Za-z0-9._:@+-]*|\.[A-Za-z0-9_:@+-][A-Za-z0-9._:@+-]*"
_DOC_ID = re.compile(rf"(?:{_ID_SEGMENT})(?:/(?:{_ID_SEGMENT}))*")
DOC_ID_MAX_CHARS = 200
COLLECTION_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
DEFAULT_COLLECTION = "default"
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def encodable(value: str) -> str:
    """Refuses lone surrogates (JSON may carry "\\udc00"): they cannot be encoded as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text holds a character that is not valid Unicode at {exc.start}"
        ) from None
    return value


def safe_doc_id(value: str) -> str:
    if not _DOC_ID.fullmatch(value):
        raise ValueError(
            "doc id: letters, digits and ._:@+- in '/'-separated segments, none of them "
            "empty, '.' or '..'"
        )
    return value


Text = Annotated[str, AfterValidator(encodable)]
DocId = Annotated[
    str, Field(min_length=1, max_length=DOC_ID_MAX_CHARS), AfterValidator(safe_doc_id)
]
CollectionName = Annotated[str, Field(pattern=COLLECTION_PATTERN)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
