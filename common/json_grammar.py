"""The grammar of a response_format's JSON schema (llguidance), built alike by the gateway, which
checks it before retrieving, and the engine, which compiles it against its tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON with Python's separators and no free whitespace: a small model allowed any
# whitespace between tokens can emit newlines until max_tokens instead of closing the object.
# A schema's own "x-guidance" settings override these.
COMPILE_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class SchemaError(ValueError):
    """A JSON schema the grammar library cannot compile; the message is the library's."""


def json_grammar(schema_text: str) -> str:
    """The llguidance grammar of the serialized JSON schema; raises SchemaError when it is not
    a JSON object. It is checked by `check_grammar` or when a matcher is built from it."""
    try:
        return LLMatcher.grammar_from_json_schema(schema_text, defaults=COMPILE_DEFAULTS)
    except ValueError as exc:
        raise SchemaError(str(exc)) from exc


def check_grammar(grammar: str) -> None:
    """Raise SchemaError naming what the library rejects in `grammar` (no tokenizer needed:
    unknown types, missing $refs, bad patterns, unsatisfiable bounds)."""
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise SchemaError(problem)
