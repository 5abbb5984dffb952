"""Several prefills in one forward: 8 prompts arriving at once, prefilled side by side (their
projections and MLPs batched per layer, engine/blend/dense.py) against one after another, all 8 in
one batch and grouped as the engine groups them (`prefill_batch_tokens`).

    .venv/bin/python research/prefill_batch.py                  # CPU, llama-124m bf16, ~3 min
    .venv/bin/python research/prefill_batch.py --device cuda    # mistral-7b shape

Per (mode, prompt length): `--arrivals` prompts of chunks from the store's memory tier plus a
32-token question, prefilled by the engine's Prefiller under one unbounded step, timed
round-robin (`--repeats` medians): one after another (each prompt's first token at its own
end; the mean TTFT is the mean of those ends), all side by side (every first token at the
end) and in the engine's groups (consecutive prompts of at most `--batch-tokens` in total,
default the device's, side by side; each group's tokens at its end).
Prints a table and writes bench/results/prefill_batch-<device>.csv.
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads; passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
import torch  # noqa: E402
from harness import (  # noqa: E402
    SHAPES,
    build_model,
    build_store,
    default_dtype,
    interleaved_medians,
    store_chunks,
    synchronize,
    token_sampler,
    write_rows,
)

from engine.blend.budget import StepBudget  # noqa: E402
from engine.blend.dense import advance_together, run_to_end, side_by_side  # noqa: E402
from engine.blend.layout import PromptLayout  # noqa: E402
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine  # noqa: E402
from engine.options import prefill_batch_default  # noqa: E402
from engine.types import GenerateRequest, Mode  # noqa: E402


@dataclass(frozen=True)
class Row:
    mode: str
    prompt_tokens: int
    arrivals: int
    batch_tokens: int
    sequential_s: float
    side_by_side_s: float
    ratio: float  # all side by side / one after another
    grouped_s: float
    grouped_ratio: float
    sequential_mean_ttft_s: float
    side_by_side_mean_ttft_s: float
    grouped_mean_ttft_s: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", choices=SHAPES, help="default: llama-124m, mistral-7b on cuda")
    parser.add_argument("--arrivals", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 12])
    parser.add_argument("--modes", nargs="+", default=["full_prefill", "cacheblend"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-tokens", type=int, help="the engine's prefill_batch_tokens (default: device's)"
    )
    args = parser.parse_args()
    if args.arrivals < 1 or args.repeats < 1 or min(args.chunks) < 1:
        parser.error("--arrivals, --repeats and --chunks must be >= 1")
    args.shape = args.shape or ("mistral-7b" if args.device == "cuda" else "llama-124m")
    if args.batch_tokens is None:
        args.batch_tokens = prefill_batch_default(args.device)
    return args


def main() -> None:
    args = parse_args()
    loaded = build_model(args.shape, args.device, args.dtype)
    engine = Engine(loaded, build_store(loaded), max_num_seqs=1, max_model_len=8192)
    tokens = token_sampler(engine, seed=3)
    prefix = engine.prompts.build("q", []).prefix
    rows = []
    try:
        for num_chunks in args.chunks:
            layouts = [
                PromptLayout(
                    prefix, tuple(tokens(args.chunk_tokens) for _ in range(num_chunks)), tokens(32)
                )
                for _ in range(args.arrivals)
            ]
            for layout in layouts:
                store_chunks(engine, layout, fastest_tier=True)
            for mode in [Mode(m) for m in args.modes]:
                rows.append(measure(engine, mode, layouts, args))
                print_row(rows[-1])
    finally:
        engine.close()
    write_rows(f"prefill_batch-{args.device}.csv", rows)


def measure(engine: Engine, mode: Mode, layouts: list[PromptLayout], args) -> Row:
    ratio = 0.15 if mode is Mode.CACHEBLEND else None
    request = GenerateRequest(
        question="q", chunks=(), mode=mode, recompute_ratio=ratio, max_tokens=1
    )
    prefiller, device = engine.prefiller, engine.device
    ends: dict[str, list[float]] = {}

    def sequential() -> None:
        start, ends["sequential"] = time.perf_counter(), []
        for layout in layouts:
            run_to_end(prefiller.prefill(layout, PrefillAsk.of(request), StepBudget()))
            synchronize(device)
            ends["sequential"].append(time.perf_counter() - start)

    def grouped(name: str, groups: list[list[int]]) -> None:
        start, ends[name] = time.perf_counter(), []
        for group in groups:
            budget = StepBudget()
            pausables = [
                prefiller.prefill(layouts[i], PrefillAsk.of(request), budget) for i in group
            ]
            with torch.inference_mode():
                advance_together(pausables, lambda index, prefill: None, failed)
            synchronize(device)
            ends[name] += [time.perf_counter() - start] * len(group)

    every = [list(range(len(layouts)))]
    groups = side_by_side([layout.num_tokens for layout in layouts], args.batch_tokens)
    timed = interleaved_medians(
        {
            "sequential": (sequential, lambda: None),
            "side by side": (lambda: grouped("side by side", every), lambda: None),
            "grouped": (lambda: grouped("grouped", groups), lambda: None),
        },
        args.repeats,
        device,
    )
    seq_s, side_s, grouped_s = (
        timed[name][0] for name in ("sequential", "side by side", "grouped")
    )
    return Row(
        mode=mode.value,
        prompt_tokens=layouts[0].num_tokens,
        arrivals=len(layouts),
        batch_tokens=args.batch_tokens,
        sequential_s=seq_s,
        side_by_side_s=side_s,
        ratio=side_s / seq_s,
        grouped_s=grouped_s,
        grouped_ratio=grouped_s / seq_s,
        sequential_mean_ttft_s=sum(ends["sequential"]) / len(layouts),
        side_by_side_mean_ttft_s=sum(ends["side by side"]) / len(layouts),
        grouped_mean_ttft_s=sum(ends["grouped"]) / len(layouts),
    )


def failed(index: int, exc: Exception) -> None:
    raise exc


def print_row(row: Row) -> None:
    print(
        f"{row.mode:12s} {row.arrivals} x {row.prompt_tokens:5d} tokens: one after another "
        f"{row.sequential_s:6.3f} s, all side by side {row.side_by_side_s:6.3f} s "
        f"({row.ratio:.2f}x), grouped by {row.batch_tokens} {row.grouped_s:6.3f} s "
        f"({row.grouped_ratio:.2f}x); mean TTFT {row.sequential_mean_ttft_s:.3f} / "
        f"{row.side_by_side_mean_ttft_s:.3f} / {row.grouped_mean_ttft_s:.3f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
