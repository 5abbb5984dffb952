"""JSON schemas compiled against a tokenizer: cached per schema, one independent matcher per
sequence, EOS allowed only once the output is a whole document, and errors naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

from demo.tiny import build_tokenizer
from engine.errors import GrammarError
from engine.grammar.compile import GrammarCompiler
from engine.grammar.mask import bitmask_words

OBJECT = json.dumps(
    {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def allowed(grammar, vocab_size: int) -> set[int]:
    words = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)
    grammar.fill(words)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def feed(grammar, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.advance(token)


def test_a_schema_compiles_once_and_is_reused(compiler):
    assert compiler.compile(OBJECT) is compiler.compile(OBJECT)


def test_eos_is_allowed_only_once_the_output_is_a_whole_document(compiler, tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    grammar = compiler.compile(OBJECT).start()
    assert eos not in allowed(grammar, vocab)
    feed(grammar, tokenizer, '{"n": 12')
    assert not grammar.complete
    assert eos not in allowed(grammar, vocab)
    feed(grammar, tokenizer, "}")
    assert grammar.complete
    assert allowed(grammar, vocab) == {eos}


def test_each_sequence_keeps_its_own_state(compiler, tokenizer):
    compiled = compiler.compile(OBJECT)
    first, second = compiled.start(), compiled.start()
    feed(first, tokenizer, '{"n": 1}')
    assert first.complete and not second.complete
    assert compiled.start().complete is False  # the cached start state is untouched


def test_a_token_the_grammar_forbids_is_a_grammar_error(compiler, tokenizer):
    grammar = compiler.compile(OBJECT).start()
    with pytest.raises(GrammarError, match="rejected token"):
        feed(grammar, tokenizer, "[")


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "Invalid type: strin"),
        ({"$ref": "#/definitions/missing"}, "does not exist"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"type": "object", "minProperties": 3, "maxProperties": 1}, "Unsatisfiable"),
    ],
)
def test_a_schema_the_library_cannot_compile_is_a_grammar_error_with_its_message(
    compiler, schema, problem
):
    with pytest.raises(GrammarError, match="response_format") as caught:
        compiler.compile(json.dumps(schema))
    assert problem in str(caught.value)
