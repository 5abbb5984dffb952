"""Smoke run of the experiments (research/), as bench/smoke.py runs the benchmarks (its runner,
these cases): each script at its smallest in a subprocess, its files in a scratch folder.

    .venv/bin/python research/smoke.py                  # every case below, ~3 min on 2 cores
    .venv/bin/python research/smoke.py quality          # that case only

`make bench-smoke` runs it after bench/smoke.py. quality.py and retrieval_quality.py run on the
demo model, with the retriever's MiniLM over the few questions' documents; structured_output.py
on the packaged SmolLM2 (converted on first use), llguidance alone without xgrammar.

Not covered:
- retriever_memory.py: a retriever process under rounds of 100K-character ingests.
- generation_defaults.py: a real checkpoint (SmolLM2, converted from its GGUF file on first
  use: its 4096 positions exceed the demo model's 1024) and minutes of CPU per run.
- ann.py: the retriever's, not the engine's; MiniLM embeds hundreds of texts before anything is
  measured (~30 s at its smallest on 2 busy cores).
"""

from __future__ import annotations

import sys

import _on_path  # noqa: F401  (the checkout and bench/ on sys.path)

from bench.smoke import MODEL, Case, main

CASES = (
    Case("cache_churn", ("--quick",), "research"),
    Case("cpu_linear", ("--quick",), "research"),
    Case(
        "kv_codec",
        ("--layers 2 --kv-heads 2 --tokens 64 --head-dim 64 --chunks 2 --repeats 1",),
        "research",
    ),
    # 3 prompts of ~150 tokens under a 320-token batch: one group of two, one alone.
    Case(
        "prefill_batch",
        (f"{MODEL} --arrivals 3 --chunks 1 --chunk-tokens 64 --batch-tokens 320 --repeats 1",),
        "research",
    ),
    Case(
        "prefill_pieces",
        (f"{MODEL} --chunks 2 --chunk-tokens 64 --budgets 64 --rounds 1",),
        "research",
    ),
    Case(
        "decode_fused",
        (f"{MODEL} --chunks 2 --chunk-tokens 64 --decodes 2 --budget 64 --context 64 --rounds 1",),
        "research",
    ),
    Case(
        "step_budget",
        (
            f"{MODEL} --budgets 64 --requests 2 --gap-s 0.05 --chunks 2 --chunk-tokens 64 "
            "--output-tokens 4",
        ),
        "research",
    ),
    # Contexts on both sides of the 128-token prefix: the shared-prefix decode skips shorter.
    Case(
        "paged_capacity",
        (
            "--shape llama-124m --slots 2 --max-tokens 32 --trials 1 --batches 1 2 "
            "--contexts 64 200 --repeats 1 --prefix 128",
        ),
        "research",
    ),
    Case(
        "serving_decode",
        (
            f"{MODEL} --quick --chunks 2 --output-tokens 4 --decode-batches 1 2 "
            "--step-batches 1 2 --short-context 64 --long-context 255 --decode-attention auto flex",
        ),
        "research",
    ),
    Case("structured_output", ("--repeats 1",), "research"),
    # Three questions: one of each kind. Each of the script's modes is a run of its own.
    Case(
        "quality",
        (
            "--questions 3",
            "--questions 3 --baselines",
            "--questions 3 --kv-encodings none int8",
        ),
        "research",
    ),
    Case("retrieval_quality", ("--questions 3 --collection-size 3",), "research"),
)

if __name__ == "__main__":
    sys.exit(main(CASES, __doc__))
