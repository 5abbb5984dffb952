"""TTFT of the four modes side by side in one run, on a random-init model of a real shape.

CPU default: a ~124M Llama-shaped model in bfloat16, 6 chunks x 512 tokens + a 32-token
question. On CUDA: Mistral-7B's shape, 16 x 512 chunk tokens (8K). KV from the memory tier
(pinned on CUDA), and on CUDA also from the gpu tier.
Prints a table and writes bench/results/engine_ttft-<device>.csv.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from harness import (
    add_workload_arguments,
    build_engine,
    build_model,
    interleaved_medians,
    random_layout,
    store_chunks,
)

from engine.types import Mode

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    args = parser.parse_args()

    loaded = build_model(args.shape, args.device, args.dtype)
    engine = build_engine(loaded)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, args.question_tokens)
    store_chunks(engine, layout)
    chunk_total = sum(len(c) for c in layout.chunks)

    cases = [
        (mode, "memory", engine)
        for mode in (Mode.FULL_PREFILL, Mode.PREFIX_CACHE, Mode.FULL_REUSE, Mode.CACHEBLEND)
    ]
    if loaded.device.type == "cuda":  # chunk KV already in device memory: no copy at all
        gpu = build_engine(loaded, memory_budget_bytes=0, gpu_budget_bytes=64 * 1024**3)
        store_chunks(gpu, layout, fastest_tier=True)
        cases += [(Mode.FULL_REUSE, "gpu", gpu), (Mode.CACHEBLEND, "gpu", gpu)]

    def ttft(mode, bench_engine):
        def run():
            prefill = bench_engine.prefill_layout(layout, mode, args.ratio)
            int(prefill.output.logits.argmax())  # the first token
            return prefill

        return run

    measured = interleaved_medians(
        {(mode, tier): (ttft(mode, e), lambda: None) for mode, tier, e in cases},
        args.repeats,
        loaded.device,
    )
    rows = []
    for (mode, tier), (seconds, spread, prefill) in measured.items():
        rows.append(
            {
                "mode": mode.value,
                "tier": tier,
                "ttft_s": seconds,
                "stdev_s": spread,
                "recomputed_fraction": prefill.usage.recomputed_tokens / chunk_total,
            }
        )
    for row in rows:
        row["vs_full_prefill"] = row["ttft_s"] / rows[0]["ttft_s"]

    print(
        f"\n{args.shape} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens "
        f"({args.chunks} chunks x {args.chunk_tokens} + {args.question_tokens}-token question), "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} rounds"
    )
    print(f"{'mode':<14}{'tier':<8}{'TTFT s':>10}{'stdev s':>10}{'recomputed':>12}{'vs full':>10}")
    for row in rows:
        print(
            f"{row['mode']:<14}{row['tier']:<8}{row['ttft_s']:>10.4f}{row['stdev_s']:>10.4f}"
            f"{row['recomputed_fraction']:>12.1%}{row['vs_full_prefill']:>10.3f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine_ttft-{args.device}.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["device", "shape", "dtype", "prompt_tokens", *rows[0]]
        )
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    "device": args.device,
                    "shape": args.shape,
                    "dtype": args.dtype,
                    "prompt_tokens": layout.num_tokens,
                    **row,
                }
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
