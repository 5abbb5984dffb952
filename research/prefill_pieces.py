"""What a prefill costs in pieces: one prompt prefilled whole and in steps of a token budget,
side by side on one model, the time summed over its pieces against the whole prefill's.

    .venv/bin/python research/prefill_pieces.py                    # ~2 min on 2 cores
    .venv/bin/python research/prefill_pieces.py --budgets 128 512 --rounds 5

Per (mode, budget): one prompt of `--chunks` (6) pooled `--chunk-tokens` (512) chunks + a
32-token question, prefilled in steps of `budget` tokens x L token-layers (the engine's step
budget), nothing else in the step. The budgets of a round run one after the other; medians
over rounds: what a smaller `max_num_batched_tokens` costs a prefill. Prints a table and writes
bench/results/prefill_pieces-<device>.csv.
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads; passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
from harness import (  # noqa: E402
    SHAPES,
    build_engine,
    build_model,
    default_dtype,
    random_layout,
    store_chunks,
    write_rows,
)

from engine.blend.budget import StepBudget  # noqa: E402
from engine.blend.dense import advance  # noqa: E402
from engine.blend.layout import PromptLayout  # noqa: E402
from engine.blend.prefill import PrefillAsk  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.types import Mode  # noqa: E402


@dataclass(frozen=True)
class Row:
    mode: str
    budget_tokens: float  # inf: whole
    steps: int
    prefill_s: float
    vs_whole: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", default="llama-124m", choices=SHAPES)
    parser.add_argument("--modes", nargs="+", default=["full_prefill", "cacheblend"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 512, 256, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    args = parser.parse_args()
    if min(args.budgets) < 1 or args.rounds < 1 or args.chunks < 1 or args.chunk_tokens < 1:
        parser.error("--budgets, --rounds, --chunks and --chunk-tokens must be >= 1")
    return args


def prefill_in_steps(engine: Engine, layout: PromptLayout, mode: Mode, tokens: float) -> int:
    """Prefill `layout` in steps of `tokens` x L token-layers; the number of steps."""
    budget = StepBudget()
    steps = engine.prefiller.prefill(
        layout, PrefillAsk(mode, 0.15 if mode is Mode.CACHEBLEND else None), budget
    )
    count, done = 0, False
    while not done:
        budget.refill(tokens * engine.ops.shape.num_layers)
        done, _ = advance(steps)
        count += 1
    return count


def main() -> None:
    args = parse_args()
    loaded = build_model(args.shape, args.device, args.dtype)
    engine = build_engine(loaded, max_num_seqs=1, max_model_len=4096)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, 32)
    store_chunks(engine, layout)
    budgets = [math.inf, *args.budgets]
    rows: list[Row] = []
    for mode in [Mode(m) for m in args.modes]:
        prefill_in_steps(engine, layout, mode, math.inf)  # warm-up
        seconds: dict[float, list[float]] = {b: [] for b in budgets}
        steps: dict[float, int] = {}
        for _ in range(args.rounds):
            for tokens in budgets:
                start = time.perf_counter()
                steps[tokens] = prefill_in_steps(engine, layout, mode, tokens)
                seconds[tokens].append(time.perf_counter() - start)
        whole = statistics.median(seconds[math.inf])
        for tokens in budgets:
            total = statistics.median(seconds[tokens])
            row = Row(mode.value, tokens, steps[tokens], total, total / whole)
            rows.append(row)
            print(
                f"{row.mode:12s} budget {tokens:>5} tokens: {row.steps:3d} steps, "
                f"{total:6.3f} s ({row.vs_whole:.2f}x whole)",
                flush=True,
            )
    engine.close()
    write_rows(f"prefill_pieces-{args.device}.csv", rows)


if __name__ == "__main__":
    main()
