"""TTFT of the four modes side by side in one run, on a random-init model of a real shape or a
real checkpoint (`--model`, e.g. SmolLM2-135M-Instruct).

CPU default: a ~124M Llama-shaped model in bfloat16, 6 chunks x 512 tokens + a 32-token
question. On CUDA: Mistral-7B's shape, 16 x 512 chunk tokens (8K). KV from the memory tier
(pinned on CUDA), and on CUDA also from the gpu tier. cacheblend runs at each of `--ratios`;
`--profile` adds where the layer loop spends each mode's time.
Prints tables and writes bench/results/engine_ttft-<device>.csv (engine_ttft-<tag>-<device>.csv
with `--model`; the tag defaults to the checkpoint's name).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch
from harness import (
    add_workload_arguments,
    build_engine,
    interleaved_medians,
    model_label,
    random_layout,
    results_name,
    store_chunks,
    workload_model,
)
from layer_profile import PARTS, LayerProfile
from paths import results_dir, shown

from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.types import Mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument(
        "--ratios", type=float, nargs="+", help="cacheblend's recompute ratios (default: --ratio)"
    )
    parser.add_argument("--profile", action="store_true", help="time the layer loop's parts")
    args = parser.parse_args()
    ratios = args.ratios or [args.ratio]
    if not all(0 <= r <= 1 for r in ratios):
        parser.error("--ratios must lie in [0, 1]")

    loaded = workload_model(args)
    engine = build_engine(loaded)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, args.question_tokens)
    store_chunks(engine, layout)
    chunk_total = sum(len(c) for c in layout.chunks)
    profile = LayerProfile(engine.ops, loaded.device) if args.profile else None

    cases = [
        (mode, None, "memory", engine)
        for mode in (Mode.FULL_PREFILL, Mode.PREFIX_CACHE, Mode.FULL_REUSE)
    ]
    cases += [(Mode.CACHEBLEND, ratio, "memory", engine) for ratio in ratios]
    if loaded.device.type == "cuda":  # chunk KV already in device memory: no copy at all
        gpu = build_engine(loaded, memory_budget_bytes=0, gpu_budget_bytes=64 * 1024**3)
        store_chunks(gpu, layout, fastest_tier=True)
        cases += [(Mode.FULL_REUSE, None, "gpu", gpu)]
        cases += [(Mode.CACHEBLEND, ratio, "gpu", gpu) for ratio in ratios]
    parts: dict[tuple, list[dict[str, float]]] = {case[:3]: [] for case in cases}

    def ttft(mode, ratio, tier, bench_engine):
        def run():
            start = time.perf_counter()
            prefill = run_to_end(bench_engine.prefiller.prefill(layout, PrefillAsk(mode, ratio)))
            int(prefill.output.logits.argmax())  # the first token
            if profile is not None:
                parts[mode, ratio, tier].append(profile.take(time.perf_counter() - start))
            return prefill

        return run

    try:
        measured = interleaved_medians(
            {case[:3]: (ttft(*case), lambda: None) for case in cases}, args.repeats, loaded.device
        )
    finally:
        for bench_engine in {id(case[3]): case[3] for case in cases}.values():
            bench_engine.close()
    rows = []
    for (mode, ratio, tier), (seconds, spread, prefill) in measured.items():
        rows.append(
            {
                "mode": mode.value,
                "ratio": "" if ratio is None else ratio,
                "tier": tier,
                "ttft_s": seconds,
                "stdev_s": spread,
                "recomputed_fraction": prefill.usage.recomputed_tokens / chunk_total,
            }
        )
    for row in rows:
        row["vs_full_prefill"] = row["ttft_s"] / rows[0]["ttft_s"]

    label = model_label(args)
    print(
        f"\n{label} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens "
        f"({args.chunks} chunks x {args.chunk_tokens} + {args.question_tokens}-token question), "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} interleaved rounds"
    )
    print(
        f"{'mode':<14}{'r':>6}{'tier':>8}{'TTFT s':>10}{'stdev s':>10}"
        f"{'recomputed':>12}{'vs full':>10}"
    )
    for row in rows:
        print(
            f"{row['mode']:<14}{row['ratio']!s:>6}{row['tier']:>8}{row['ttft_s']:>10.4f}"
            f"{row['stdev_s']:>10.4f}{row['recomputed_fraction']:>12.1%}"
            f"{row['vs_full_prefill']:>10.3f}"
        )
    if profile is not None:
        print("\nlayer loop parts, seconds (median per prefill; other: KV assembly, selection)")
        names = [*PARTS.values(), "other"]
        print(f"{'mode':<14}{'r':>6}{'tier':>8}" + "".join(f"{n:>14}" for n in names))
        for (mode, ratio, tier), samples in parts.items():
            timed = samples[1:]  # the warm-up round is not counted
            print(
                f"{mode.value:<14}{'' if ratio is None else ratio!s:>6}{tier:>8}"
                + "".join(f"{statistics.median(s[n] for s in timed):>14.4f}" for n in names)
            )
    out = results_dir() / results_name(args, "engine_ttft")
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["device", "model", "dtype", "prompt_tokens", *rows[0]]
        )
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    "device": args.device,
                    "model": label,
                    "dtype": args.dtype,
                    "prompt_tokens": layout.num_tokens,
                    **row,
                }
            )
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
