"""A step that decodes and prefills: the decode as a forward of its own before the prefill's
piece, against the decode rows fused into the piece's forward, side by side on one model.

    .venv/bin/python research/decode_fused.py                  # ~3 min on 2 cores
    .venv/bin/python research/decode_fused.py --decodes 1 8 --rounds 3

Per (mode, decode batch, variant): one prompt of `--chunks` (6) pooled `--chunk-tokens` (512)
chunks + a 32-token question prefilled in steps of `--budget` tokens x L token-layers (the
engine's step budget, so both variants do the same prefill work per step), each step also
decoding `--decodes` sequences at `--context` positions. Reports the steps, their median and
p90 time and the prefill's total time; the variants of a round run one after the other,
medians over rounds. Prints a table and writes bench/results/decode_fused-<device>.csv.
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads; passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
import torch  # noqa: E402
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
from engine.blend.dense import advance, advance_together  # noqa: E402
from engine.blend.layout import PromptLayout  # noqa: E402
from engine.blend.prefill import PrefillAsk  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sched.blocks import BlockManager  # noqa: E402
from engine.types import Mode  # noqa: E402

VARIANTS = ("separate", "fused")


@dataclass(frozen=True)
class Row:
    mode: str
    decodes: int
    variant: str
    steps: int
    step_p50_s: float
    step_p90_s: float
    prefill_s: float
    prefill_vs_separate: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", default="llama-124m", choices=SHAPES)
    parser.add_argument("--modes", nargs="+", default=["full_prefill", "cacheblend"])
    parser.add_argument("--decodes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    args = parser.parse_args()
    if min(args.decodes) < 1 or args.budget <= max(args.decodes) or args.rounds < 1:
        parser.error("--decodes must be >= 1 and below --budget, --rounds >= 1")
    if args.chunks < 1 or args.chunk_tokens < 1:
        parser.error("--chunks and --chunk-tokens must be >= 1")
    return args


def prefill_in_steps(
    engine: Engine, layout: PromptLayout, mode: Mode, decode, per_step: int, fused: bool
) -> list[float]:
    """Each step's seconds: a piece of the prefill and one decode of `decode`'s rows."""
    budget = StepBudget()
    ratio = 0.15 if mode is Mode.CACHEBLEND else None
    steps = engine.prefiller.prefill(layout, PrefillAsk(mode, ratio), budget)
    times, done = [], False

    def failed(index: int, exc: Exception) -> None:
        raise exc

    while not done:
        budget.refill(per_step)
        start = time.perf_counter()
        with torch.inference_mode():
            if fused:
                results: dict = {}
                advance_together(
                    [steps, engine.runner.decode_steps(*decode)], results.__setitem__, failed
                )
                done = 0 in results
            else:
                engine.runner.decode(*decode)
                done, _ = advance(steps)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    loaded = build_model(args.shape, args.device, args.dtype)
    engine = build_engine(loaded, max_num_seqs=max(args.decodes), max_model_len=4096)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, 32)
    store_chunks(engine, layout)
    layers = engine.ops.shape.num_layers
    pool = BlockManager(engine.runner.num_blocks, engine.runner.block_size)
    tables = [pool.allocate(i, args.context + 1) for i in range(max(args.decodes))]
    rows: list[Row] = []
    for mode in [Mode(m) for m in args.modes]:
        for batch in args.decodes:
            decode = (tables[:batch], [args.context] * batch, [5] * batch)
            per_step = (args.budget - batch) * layers
            # A warm-up of each variant: on a GPU a shape's first run pays for allocations and
            # kernel plans (a cacheblend step there took 720 ms the first time, ~150 ms after).
            for variant in VARIANTS:
                prefill_in_steps(engine, layout, mode, decode, per_step, variant == "fused")
            runs: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    fused = variant == "fused"
                    runs[variant].append(
                        prefill_in_steps(engine, layout, mode, decode, per_step, fused)
                    )
            separate_s = statistics.median(sum(t) for t in runs["separate"])
            for variant in VARIANTS:
                every = sorted(t for times in runs[variant] for t in times)
                total = statistics.median(sum(t) for t in runs[variant])
                row = Row(
                    mode.value,
                    batch,
                    variant,
                    round(statistics.median(len(t) for t in runs[variant])),
                    statistics.median(every),
                    every[min(len(every) - 1, int(0.9 * len(every)))],
                    total,
                    total / separate_s,
                )
                rows.append(row)
                print(
                    f"{row.mode:12s} decodes {batch:2d} {variant:8s} steps {row.steps:3d} "
                    f"p50 {row.step_p50_s * 1000:6.1f} ms p90 {row.step_p90_s * 1000:6.1f} ms "
                    f"prefill {total:6.2f} s ({row.prefill_vs_separate:.2f}x)",
                    flush=True,
                )
    engine.close()
    write_rows(f"decode_fused-{args.device}.csv", rows)


if __name__ == "__main__":
    main()
