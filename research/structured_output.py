"""Per-token CPU cost of structured outputs with xgrammar and llguidance, side by side.

For each JSON schema, a document that validates against it is tokenized with SmolLM2's tokenizer
(vocab 49152) and fed token by token to each library's matcher, as the engine's decode step does:
fill the next-token bitmask, mask a [1, 49152] float32 logits row with it, advance the matcher by
the token. Each part is timed per token (median over the repeats); compile time is the first
compile of the schema with no cache, the first fill that of a fresh compile, and setup the
one-off tokenizer import per engine. Both libraries compile with flexible whitespace (their
default). xgrammar is no dependency of the project: without it, llguidance alone is measured
(pip install xgrammar==0.2.9 for the comparison). The mask is applied by the
engine's own unpacking (engine/grammar/mask.py), the same for both, and by xgrammar's own CPU
kernel for reference. Prints a table; writes bench/results/structured_output-cpu.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import _on_path  # noqa: F401  (the checkout, for tests/real_model.py's SmolLM2)
import torch

from bench.paths import results_dir, shown  # noqa: E402
from engine.grammar.mask import apply_bitmask, bitmask_words  # noqa: E402
from tests.real_model import smollm2_checkpoint  # noqa: E402

VOCAB = 49152  # SmolLM2's

SCHEMAS: dict[str, tuple[dict, object]] = {
    "object": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "enum": (
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
        {"color": "green"},
    ),
    "array": (
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8},
        ["Paris", "London", "Rome", "Berlin", "Madrid"],
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "year": {"type": "integer", "minimum": 1900},
                "rating": {"type": "number"},
                "available": {"type": "boolean"},
                "authors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "country": {"type": "string"},
                        },
                        "required": ["name"],
                    },
                },
            },
            "required": ["title", "year", "authors"],
        },
        {
            "title": "The Art of Computer Programming",
            "year": 1968,
            "rating": 4.9,
            "available": True,
            "authors": [{"name": "Donald Knuth", "country": "United States"}],
        },
    ),
    "json_object": (
        {"type": "object"},
        {"answer": "42", "sources": [1, 2], "meta": {"ok": True, "note": None}},
    ),
}


@dataclass(frozen=True)
class Row:
    library: str
    schema: str
    num_tokens: int
    compile_ms: float
    first_fill_us: float  # the first mask of a sequence of a fresh compile
    fill_us: float
    apply_us: float
    advance_us: float
    per_token_us: float  # fill + apply + advance
    native_apply_us: float  # the library's own mask kernel (xgrammar only)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


class Library:
    """One library behind the three calls the decode step makes."""

    name: str

    def compile(self, schema: dict) -> object: ...

    def matcher(self, compiled: object) -> object: ...

    def fill(self, matcher: object, bitmask: torch.Tensor) -> None: ...

    def advance(self, matcher: object, token: int) -> None: ...

    native_apply: Callable[[torch.Tensor, torch.Tensor], None] | None = None


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        self.tokenizer_info = info
        self.native_apply = lambda logits, mask: xgr.apply_token_bitmask_inplace(
            logits, mask, backend="cpu"
        )

    def compile(self, schema: dict) -> object:
        compiler = self.xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        if schema == {"type": "object"}:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: object) -> object:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


class Llguidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)

    def compile(self, schema: dict) -> object:
        # The grammar's parser is built with the matcher; a fresh matcher is the compile.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        compiled = self.llg.LLMatcher(self.tokenizer, grammar)
        compiled.compute_bitmask()  # as the engine does: its lexer is built lazily
        assert not compiled.is_error(), compiled.get_error()
        return compiled

    def matcher(self, compiled) -> object:
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


def measure(lib: Library, schema_name: str, token_ids: list[int], repeats: int) -> Row:
    schema = SCHEMAS[schema_name][0]
    start = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    logits = torch.randn(1, VOCAB)
    fills, applies, advances, natives = [], [], [], []
    for _ in range(repeats):
        matcher = lib.matcher(compiled)
        for token in token_ids:
            t0 = time.perf_counter()
            lib.fill(matcher, bitmask)
            t1 = time.perf_counter()
            apply_bitmask(logits, bitmask, torch.tensor([0]))
            t2 = time.perf_counter()
            lib.advance(matcher, token)
            t3 = time.perf_counter()
            fills.append(t1 - t0)
            applies.append(t2 - t1)
            advances.append(t3 - t2)
            if lib.native_apply is not None:
                t4 = time.perf_counter()
                lib.native_apply(logits, bitmask)
                natives.append(time.perf_counter() - t4)
    fill_us, apply_us, advance_us = median_us(fills), median_us(applies), median_us(advances)
    return Row(
        lib.name,
        schema_name,
        len(token_ids),
        compile_ms,
        fills[0] * 1e6,
        fill_us,
        apply_us,
        advance_us,
        fill_us + apply_us + advance_us,
        median_us(natives) if natives else float("nan"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    libraries: list[Library] = []
    setup_s: dict[str, float] = {}
    for cls in (Xgrammar, Llguidance):
        start = time.perf_counter()
        try:
            libraries.append(cls(tokenizer))
        except ImportError as exc:  # xgrammar is no dependency: pip install xgrammar==0.2.9
            print(f"{cls.name} left out: {exc}")
            continue
        setup_s[cls.name] = time.perf_counter() - start
    rows = []
    for schema_name, (_, document) in SCHEMAS.items():
        token_ids = tokenizer.encode(json.dumps(document))
        for lib in libraries:
            rows.append(measure(lib, schema_name, token_ids, args.repeats))
    path = results_dir() / "structured_output-cpu.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*Row.__dataclass_fields__, "setup_s"])
        for row in rows:
            values = [round(v, 2) if isinstance(v, float) else v for v in row.__dict__.values()]
            writer.writerow([*values, round(setup_s[row.library], 3)])
    print(
        f"{'library':11} {'schema':12} {'tokens':>6} {'compile ms':>10} {'1st fill us':>11} "
        f"{'fill us':>8} "
        f"{'apply us':>8} {'advance us':>10} {'per token us':>12} {'native apply us':>15}"
    )
    for r in rows:
        print(
            f"{r.library:11} {r.schema:12} {r.num_tokens:6d} {r.compile_ms:10.2f} "
            f"{r.first_fill_us:11.1f} {r.fill_us:8.1f} {r.apply_us:8.1f} {r.advance_us:10.1f} "
            f"{r.per_token_us:12.1f} "
            f"{r.native_apply_us:15.1f}"
        )
    print("setup (tokenizer import) s:", {k: round(v, 3) for k, v in setup_s.items()})
    print("wrote", shown(path))


if __name__ == "__main__":
    main()
