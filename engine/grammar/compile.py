"""JSON schemas compiled into llguidance matchers against the model's tokenizer, once per schema:
each sequence starts from a copy of its schema's compiled matcher."""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf

from common.json_grammar import SchemaError, json_grammar
from engine.errors import GrammarError

# Compiled schemas kept; a request whose schema was compiled before starts from a copy.
CACHE_ENTRIES = 64


class SequenceGrammar:
    """One sequence's position in its grammar: which tokens may come next, and whether the
    output is complete."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill(self, words) -> None:
        """Write the allowed next tokens into `words`, one int32 bitmask row (CPU, contiguous):
        EOS among them only where the grammar accepts the output as it is."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def advance(self, token_id: int) -> None:
        """The sequence took `token_id`; raises GrammarError for one the grammar forbids (its
        mask allowed it, so the matcher has failed)."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """No token but EOS may follow: the output is a whole document of the grammar."""
        return self.matcher.is_stopped()


class CompiledGrammar:
    """A schema's matcher in its start state, copied for each sequence."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._start = matcher

    def start(self) -> SequenceGrammar:
        return SequenceGrammar(self._start.deep_copy())


class GrammarCompiler:
    """Compiles a request's JSON schema against the model's tokenizer (vocab `vocab_size`, the
    logits' width; `eos_ids`: the tokens that end the output, allowed once it is complete).
    Safe to call from several threads; the tokenizer is imported on the first compile."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, schema_text: str) -> CompiledGrammar:
        """The compiled grammar of a serialized JSON schema; raises GrammarError naming what
        the library rejects. A request waits for it (milliseconds,
        docs/benchmarks/structured-output.md): call it off the engine thread (the service calls
        it on a thread, as it tokenizes)."""
        with self._lock:
            compiled = self._compiled.get(schema_text)
            if compiled is not None:
                self._compiled.move_to_end(schema_text)
                return compiled
        try:
            grammar = json_grammar(schema_text)
        except SchemaError as exc:
            raise GrammarError(f"response_format: {exc}") from exc
        # Building the matcher compiles the grammar (and drops the GIL while it does).
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        # The first mask builds the lexer's states, the longest mask of a sequence
        # (docs/benchmarks/structured-output.md): here, not in a decode step; the copies
        # inherit them.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"response_format: the JSON schema: {matcher.get_error()}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._compiled[schema_text] = compiled
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids
                    )
                except Exception as exc:  # a slow (Python) tokenizer: no vocabulary to read
                    raise GrammarError(
                        f"response_format: structured outputs need a fast tokenizer: {exc}"
                    ) from exc
            return self._tokenizer
